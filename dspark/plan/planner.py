"""VerifyPlanner: the per-step orchestrator from confidence logits to a verify layout.

Each `plan` call:
1. live survival from the logits (STS temperatures);
2. the budget from survival at least `lag` steps old, read from the lag ring under the generation
   guard (non-anticipation, DESIGN.md 4.4); with `lag = 0` the greedy scan over live survival;
3. graph-tier fill (DESIGN.md 4.7): when tiers are given, the padding of the tier the chosen rows will
   replay is already paid for, so the allocation budget grows to the tier top (never across it);
4. the allocation from live survival (global top-k) and the ragged layout padded to the tier;
5. with `parallel=ParallelConfig(...)`: TP ranks agree on `verify_lens` (hash check or broadcast) and
   DP ranks on the global tier, idle ranks included (`dspark.parallel`).

Host syncs per step: the budget decision (one) and the layout's row total (one), plus the lag ring's
slot checks, which read host tensors when slots and generations live on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from dspark.config import ScheduleConfig
from dspark.cost import CostModel, check_cost_model
from dspark.parallel import DpTier, ParallelAgreement, ParallelConfig
from dspark.plan.allocate import allocate_verify_lens
from dspark.plan.budget import BudgetDecision, check_config, choose_budget, greedy_budget, plan_on_host
from dspark.plan.survival import (
    SurvivalLagRing,
    _check_matrix,
    check_temperatures,
    survival_from_checked,
)
from dspark.util.validate import check_int
from dspark.verify.layout import RaggedVerifyLayout, check_tiers, round_up_to_tier


@dataclass(frozen=True)
class VerifyPlan:
    """One step's plan: verify_lens [B] int32, its layout, the budget decision, the live survival.

    `budget` is what was executed: the extra rows actually allocated, sum(verify_lens) - B * F.
    `tier_budget` is what the allocation was offered: the decision's budget grown to the tier top by
    graph-tier fill; it exceeds `budget` when the candidates run out first (the rest is padding).
    `dp` is the DP-global tier decision when the planner runs with a DP group.
    """

    verify_lens: Tensor
    layout: RaggedVerifyLayout
    decision: BudgetDecision
    survival: Tensor
    budget: int
    tier_budget: int
    dp: DpTier | None = None


def tier_fill_budget(budget: int, num_requests: int, floor: int, tiers: Sequence[int]) -> int:
    """The budget that fills the tier B * F + budget rows round up to (unchanged past the largest tier)."""
    tier = round_up_to_tier(num_requests * floor + budget, tiers)
    return budget if tier is None else tier - num_requests * floor


class VerifyPlanner:
    """Stateful planner: owns the survival lag ring; one `plan` per verify step.

    num_slots: request-pool slots the ring tracks; temperatures: STS per-position temperatures
    (None = 1); tiers: captured graph token tiers (None = eager, no fill); graph_slots: captured slot
    count S handed to the layout (None = B + 1 when padding exists); parallel: TP/DP process groups
    (start-up compares the cost table's fingerprint across them; a rank with another table is refused).
    The cost model must fit the run (`check_cost_model`): its W at construction, its platform at the
    first `plan` on each device type.
    """

    def __init__(self, cfg: ScheduleConfig, cost_model: CostModel, lag: int = 1,
                 tiers: Sequence[int] | None = None, num_slots: int = 256,
                 temperatures: Tensor | Sequence[float] | None = None, graph_slots: int | None = None,
                 device: torch.device | str = "cpu", parallel: ParallelConfig | None = None):
        self.cfg = check_config(cfg)
        check_cost_model(cost_model, width=cfg.width)
        check_int("lag", lag, 0)
        if graph_slots is not None:
            check_int("graph_slots", graph_slots, 1)
        self.cost_model = cost_model
        self._platform_checked: str | None = None  # device type the cost model's platform was checked for
        self.lag = lag
        self.tiers = check_tiers(tiers)
        self.graph_slots = graph_slots
        self.temperatures = None if temperatures is None else check_temperatures(temperatures, cfg.gamma)
        self.ring = SurvivalLagRing(num_slots, cfg.gamma, lag, device) if lag > 0 else None
        if parallel is not None and not isinstance(parallel, ParallelConfig):
            raise TypeError(f"parallel must be a ParallelConfig, got {type(parallel).__name__}")
        self.parallel = None if parallel is None else ParallelAgreement(
            parallel, fingerprint=cost_model.fingerprint(), tiers=self.tiers, slots=graph_slots,
            width=cfg.width,
        )

    def plan(self, logits: Tensor, slots: Tensor, generations: Tensor) -> VerifyPlan:
        """Plan one verify step for a batch of confidence logits [B, gamma].

        slots / generations ([B] integer tensors, best kept on the CPU) key the lag ring; with lag = 0
        there is no ring and they are not read.
        """
        if _check_matrix("logits", logits).shape[1] != self.cfg.gamma:
            raise ValueError(f"logits must be [B, gamma={self.cfg.gamma}], got shape {tuple(logits.shape)}")
        if logits.device.type != self._platform_checked:  # the run's platform: where its logits live
            check_cost_model(self.cost_model, platform=logits.device.type)
            self._platform_checked = logits.device.type
        survival = survival_from_checked(logits, self.temperatures)
        host = plan_on_host(survival, self.cfg, calibrated=True,
                            small_batches=self.ring is None and self.parallel is None)
        live = survival if host is None else host  # planned where `plan_on_host` decided, once
        if self.ring is None:
            decision = greedy_budget(live, self.cost_model, self.cfg)
        else:
            lagged = self.ring.exchange(slots, generations, survival).to(survival.device)
            decision = choose_budget(lagged, self.cost_model, self.cfg)
        b = survival.shape[0]
        offered = tier_fill_budget(decision.budget, b, self.cfg.floor, self.tiers) if self.tiers else decision.budget
        verify_lens = allocate_verify_lens(live, offered, self.cfg)
        dp = None
        if self.parallel is not None:
            verify_lens = self.parallel.verify_lens(verify_lens)
        if self.parallel is not None and self.parallel.dp is not None:
            layout, dp = self.parallel.dp.step(verify_lens)
        else:
            layout = RaggedVerifyLayout.from_verify_lens(verify_lens, self.tiers or None, self.graph_slots,
                                                         width=self.cfg.width)
            if layout.verify_lens.device != survival.device:  # planned on the host for an accelerator
                layout = layout.to(survival.device)
                verify_lens = layout.verify_lens
        return VerifyPlan(verify_lens, layout, decision, survival, layout.total_rows - b * self.cfg.floor, offered, dp)
