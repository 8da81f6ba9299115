"""VerifyPlanner: the per-step orchestrator from confidence logits to a verify layout.

Each `plan` call:
1. live survival from the logits (STS temperatures);
2. the budget from survival at least `lag` steps old, read from the lag ring under the generation
   guard (non-anticipation, DESIGN.md 4.4); with `lag = 0` the greedy scan over live survival, or with
   `live_argmax` (greedy decoding only) the argmax over it;
3. graph-tier fill (DESIGN.md 4.7): when tiers are given, the padding of the tier the chosen rows will
   replay is already paid for, so the allocation budget grows to the tier top (never across it);
4. the allocation from live survival (global top-k) and the ragged layout padded to the tier; a host step whose
   candidates all clear `full_window_bound` verifies every one without the scan or the top-k (the same plan);
5. with `parallel=ParallelConfig(...)`: TP ranks agree on `verify_lens` (hash check or broadcast) and
   DP ranks on the global tier, idle ranks included (`dspark.parallel`).

Host reads per step (all through `dspark.verify.boundary.to_host`, tests/plan/test_host_boundary.py):
- planned on the host (CPU tensors; lag-0 small accelerator batches; chosen once per step, `_placement`,
  the one place a numpy host path is chosen): the survival's host copy, one read
  (none on the CPU, where it is a view);
- planned on the device: the budget's argmax, tau / theta curves and the live candidate count are
  computed there (`traced_decision`) and one read brings the budget and the count, which fix the
  total rows and so the tier; allocation and layout then run on the device without another read;
- `sync_free=True` (lag >= 1): none. The budget is chosen on the host from the lag-ring row that the
  previous step copied asynchronously (`SurvivalLagRing.next_row_to_host`), so the tier is known before
  the step starts; the layout is padded to it and built on the device (`graph_rows`), its real total
  left there. It equals the synchronous planner's verify_lens bit for bit (tests/plan/test_sync_free.py).
The lag ring's slot checks read `slots` / `generations`, host-side scheduling data (no device read when
they live on the CPU, as they should).

Checks: the configuration, cost model (its W), tiers, temperatures and lag are validated once, at
construction; a step checks only its own inputs (logits shape, slots / generations) and the cost model's
platform once per device type, then runs the unchecked stages (`_survival`, `host_choice` /
`traced_decision`, `_allocate`, `RaggedVerifyLayout._from_lens`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from dspark.config import ScheduleConfig
from dspark.cost import CostModel, check_cost_model
from dspark.kernels import dispatch
from dspark.parallel import DpTier, ParallelAgreement, ParallelConfig
from dspark.plan.allocate import _allocate
from dspark.plan.budget import (
    HOST_PLAN_MAX,
    BudgetDecision,
    HostCurves,
    HostSurvival,
    check_config,
    choose_budget,
    curves_decision,
    filled_tier_seconds,
    full_window_bound,
    host_choice,
    host_survival,
    seconds_over_window,
    traced_decision,
)
from dspark.plan.survival import (
    SurvivalLagRing,
    _check_matrix,
    _survival,
    check_temperatures,
)
from dspark.util.validate import check_int, check_tensor, check_type
from dspark.verify import boundary
from dspark.verify.layout import RaggedVerifyLayout, check_tiers, round_up_to_tier

# host layouts a planner keeps for reuse (`VerifyPlanner._host_layout`), for batches of at most this many requests:
# larger batches rarely repeat their verify lengths
LAYOUT_CACHE, LAYOUT_REUSE_MAX_REQUESTS = 4096, 8


@dataclass(frozen=True)
class VerifyPlan:
    """One step's plan: verify_lens [B] int32, its layout, the budget decision, the live survival.

    `budget` is what was executed: the extra rows actually allocated, sum(verify_lens) - B * F (None from
    a sync-free plan, whose total stays on the device).
    `tier_budget` is what the allocation was offered: the decision's budget grown to the tier top by
    graph-tier fill; it exceeds `budget` when the candidates run out first (the rest is padding).
    `decision` lives where the budget was chosen (the host, or the device: `_device_decision`); a host plan
    makes its tensors on first access, and one that took every candidate by `full_window_bound` its curves too.
    `step_seconds` is T(B, decision.rows) on the host, the step time the decision expects.
    `dp` is the DP-global tier decision when the planner runs with a DP group.
    """

    verify_lens: Tensor
    layout: RaggedVerifyLayout
    _decision: BudgetDecision | Callable[[], BudgetDecision] = field(repr=False, compare=False)
    survival: Tensor
    budget: int | None
    tier_budget: int
    step_seconds: float
    dp: DpTier | None = None

    @functools.cached_property
    def decision(self) -> BudgetDecision:
        """The budget decision (its curves over every budget)."""
        return self._decision() if callable(self._decision) else self._decision


@dataclass(frozen=True)
class PlannerSettings:
    """How a `VerifyPlanner` plans besides its schedule and cost model, checked when built.

    lag: the budget reads survival at least `lag` steps old from a ring of `num_slots` request-pool slots
    (0: no ring, the greedy scan over live survival); sync_free: choose that budget on the host from the ring
    row the previous step copied, with no device read (needs lag >= 1); tiers: captured graph token tiers,
    strictly increasing (None or empty: eager, no tier fill); graph_slots: the captured slot count S handed to
    the layout (None: B + 1 when padding exists); live_argmax (lag 0 only): the budget is the argmax of theta
    over the live survival, not the early-stop scan. A later draft's survival may then admit an earlier draft, so it
    is lossless with greedy acceptance only (any verify lengths commit the target's argmax tokens there);
    `SpecDecoder` refuses a policy planning so under sampling (`Policy.greedy_only`).
    """

    lag: int = 1
    num_slots: int = 256
    sync_free: bool = False
    tiers: Sequence[int] | None = None
    graph_slots: int | None = None
    live_argmax: bool = False

    def __post_init__(self) -> None:
        check_int("lag", self.lag, 0)
        check_type("live_argmax", self.live_argmax, bool)
        if self.live_argmax and self.lag != 0:
            raise ValueError(f"live_argmax=True chooses the budget over live survival (lag 0), got lag={self.lag}: "
                             "with lag >= 1 the budget is already the argmax over the lagged survival")
        check_int("num_slots", self.num_slots, 1)
        check_type("sync_free", self.sync_free, bool)
        if self.sync_free and self.lag < 1:
            raise ValueError(f"sync_free=True needs lag >= 1 (a lagged ring row to read), got lag={self.lag}")
        object.__setattr__(self, "tiers", check_tiers(self.tiers))
        if self.graph_slots is not None:
            check_int("graph_slots", self.graph_slots, 1)


def _chosen_decision(choose: Callable[[], tuple[int, HostCurves]]) -> BudgetDecision:
    return curves_decision(*choose())


def tier_fill(budget: int, num_requests: int, floor: int, tiers: Sequence[int]) -> tuple[int, int | None]:
    """(the budget that fills the tier B * F + budget rows round up to, that tier); past the largest tier, or
    without tiers, (budget, None)."""
    tier = round_up_to_tier(num_requests * floor + budget, tiers) if tiers else None
    return (budget, None) if tier is None else (tier - num_requests * floor, tier)


class VerifyPlanner:
    """Stateful planner: owns the survival lag ring; one `plan` per verify step.

    settings: the lag, its ring's slots, sync-free reading, graph tiers and slots (`PlannerSettings`);
    temperatures: STS per-position temperatures (None = 1); device: where the ring lives; parallel: TP/DP
    process groups (start-up compares the cost table's fingerprint and `planning_config` across them; a rank
    that differs in either is refused on every rank).
    The cost model must fit the run (`check_cost_model`): its W at construction, its platform at the
    first `plan` on each device type.
    """

    def __init__(self, cfg: ScheduleConfig, cost_model: CostModel, settings: PlannerSettings = PlannerSettings(),
                 temperatures: Tensor | Sequence[float] | None = None, device: torch.device | str = "cpu",
                 parallel: ParallelConfig | None = None):
        self.cfg = check_config(cfg)
        self.settings = check_type("settings", settings, PlannerSettings)
        lag, sync_free = settings.lag, settings.sync_free
        if sync_free and parallel is not None:
            raise ValueError(f"sync_free=True needs no parallel agreement, got parallel={parallel!r}")
        check_cost_model(cost_model, width=cfg.width)
        self.cost_model = cost_model
        self._platform_seen: str | None = None  # device type the cost model's platform was checked for
        self.lag = lag
        self.tiers = settings.tiers
        self._tier_tensors: dict[torch.device, Tensor] = {}
        self.graph_slots = graph_slots = settings.graph_slots
        self.temperatures = None if temperatures is None else check_temperatures(temperatures, cfg.gamma)
        self.ring = SurvivalLagRing(settings.num_slots, cfg.gamma, lag, device) if lag > 0 else None
        self._scan = lag == 0 and not settings.live_argmax  # the greedy early-stop scan over live survival
        self.sync_free = sync_free
        self._next_row = self.ring.next_row_to_host() if sync_free else None
        self._seconds: dict[tuple[int, torch.device], Tensor] = {}  # T(B, B*F + b) per (B, device)
        self._seconds_window_by_b: dict[int, np.ndarray] = {}  # the same on the host, per B
        self._filled_window_by_b: dict[int, list[float]] = {}  # its `filled_tier_seconds`, per B
        self._full_bound: dict[tuple[int, bool], float] = {}  # `full_window_bound` per (B, greedy)
        self._host_layouts: dict[tuple[int, bytes], RaggedVerifyLayout] = {}  # host layouts by rows, lengths
        if parallel is not None and not isinstance(parallel, ParallelConfig):
            raise TypeError(f"parallel must be a ParallelConfig, got {type(parallel).__name__}")
        self.parallel = None if parallel is None else ParallelAgreement(
            parallel, fingerprint=cost_model.fingerprint(), tiers=self.tiers, slots=graph_slots,
            width=cfg.width, planning=self.planning_config(),
        )

    def planning_config(self) -> dict[str, str]:
        """Every setting a budget, allocation or tier depends on besides the cost table, as canonical strs:
        TP / DP ranks must agree on each (`dspark.parallel.check_planning_config`)."""
        temps = None if self.temperatures is None else self.temperatures.double().tolist()
        return {
            "schedule": repr(self.cfg), "tiers": repr(self.tiers), "graph_slots": repr(self.graph_slots),
            "width": repr(self.cfg.width), "temperatures": repr(None if temps is None else [t.hex() for t in temps]),
            "lag": repr(self.lag), "num_slots": repr(self.ring.num_slots if self.ring is not None else None),
            "live_argmax": repr(self.settings.live_argmax),
        }

    def best_decision(self, survival: Tensor) -> BudgetDecision:
        """`choose_budget` for calibrated `survival` [B, gamma] (a lagged read of the ring) under this planner's
        cost model and schedule: the budget of the best expected committed tokens per second (`theta`)."""
        return choose_budget(survival, self.cost_model, self.cfg)

    def plan(self, logits: Tensor, slots: Tensor, generations: Tensor) -> VerifyPlan:
        """Plan one verify step.

        Args:
            logits: floating confidence logits [B, gamma].
            slots / generations: [B] integer tensors (best kept on the CPU) keying the lag ring; with
                lag = 0 there is no ring and they are not read.
        Returns:
            The step's VerifyPlan. The step's inputs are checked here once; the configuration, cost model
            and tiers were checked at construction, and the stages below run unchecked.
        """
        b = self._check_step(logits, slots, generations)
        host_logits, host_plan = self._placement(logits)
        survival = _survival(logits, self.temperatures, host=host_logits)
        if self.sync_free:
            return self._plan_sync_free(survival, slots, generations, host_logits)
        cfg = self.cfg
        host = host_survival(survival, calibrated=True) if host_plan else None
        lagged = None if self.ring is None else self.ring._exchange(slots, generations, survival).to(survival.device)
        if host is None:
            takes_all, (decision, budget, live_valid) = False, self._device_decision(survival, lagged)
        else:
            takes_all, budget, decision, live_valid = self._host_budget(host, lagged)
        offered, _ = tier_fill(budget, b, cfg.floor, self.tiers)
        if takes_all:
            verify_lens = torch.full((b,), cfg.cap, dtype=torch.int32)
        else:
            verify_lens = _allocate(survival if host is None else host, offered, cfg)
        dp = None
        if self.parallel is not None:
            verify_lens = self.parallel.verify_lens(verify_lens)
        if self.parallel is not None and self.parallel.dp is not None:
            layout, dp = self.parallel.dp.step(verify_lens)
        else:
            total = None if self.parallel is not None else b * cfg.floor + min(offered, live_valid)
            if host_plan and total is not None and b <= LAYOUT_REUSE_MAX_REQUESTS:
                layout = self._host_layout(verify_lens, total)
            else:
                layout = RaggedVerifyLayout._from_lens(verify_lens, self.tiers, self.graph_slots, cfg.width,
                                                         total_rows=total, host=host_plan)
            if layout.verify_lens.device != survival.device:  # planned on the host for an accelerator
                layout = layout.to(survival.device)
                verify_lens = layout.verify_lens
        return VerifyPlan(verify_lens, layout, decision, survival, layout.total_rows - b * cfg.floor, offered,
                          float(self.seconds_window(b)[budget]), dp)

    def _host_layout(self, verify_lens: Tensor, total: int) -> RaggedVerifyLayout:
        """The host-built layout of CPU `verify_lens` [B] int32 summing to `total`: a layout is a function of its
        lengths under this planner's tiers, slots and width, and its tensors are never written, so an earlier
        step's equal one is reused (at most `LAYOUT_CACHE` kept)."""
        key = total, verify_lens.numpy().tobytes()
        layout = self._host_layouts.get(key)
        if layout is None:
            if len(self._host_layouts) >= LAYOUT_CACHE:
                self._host_layouts.clear()
            layout = self._host_layouts[key] = RaggedVerifyLayout._from_lens(
                verify_lens, self.tiers, self.graph_slots, self.cfg.width, total_rows=total, host=True)
        return layout

    def _host_budget(self, live: HostSurvival, lagged: Tensor | None
                     ) -> tuple[bool, int, Callable[[], BudgetDecision], int]:
        """A host step's (whether it takes every candidate, budget, decision, live candidates): the argmax over the
        lagged survival, or at lag 0 over the live one (the greedy scan unless `live_argmax`); when `_takes_all`
        knows its answer, the decision's curves are left to a first `VerifyPlan.decision`, and its tensors always are
        (a policy reads the budget and the layout only)."""
        cfg, b = self.cfg, live.values.shape[0]
        # the ring holds calibrated rows (or ones): no repair
        budget_from = live if lagged is None else host_survival(lagged, calibrated=True)
        choose = functools.partial(host_choice, budget_from, self.cost_model, cfg, greedy=self._scan,
                                   seconds=self.seconds_window(b), tiers=self.tiers or None)
        if self._takes_all(budget_from, live, greedy=self._scan):
            every = b * cfg.num_candidate_columns
            return True, every, functools.partial(_chosen_decision, choose), every
        budget, curves = choose()
        return False, budget, functools.partial(curves_decision, budget, curves), live.window(cfg)[1]

    def _takes_all(self, budget_from: HostSurvival, live: HostSurvival, greedy: bool) -> bool:
        """Whether this host step verifies every candidate, known without the scan: each candidate the budget
        reads is at least `full_window_bound` and each live one at least survival_eps (the allocation then takes
        them all). Not with TP / DP agreement (the ranks' one path)."""
        cfg, b = self.cfg, budget_from.values.shape[0]
        if self.parallel is not None:
            return False
        key = (b, greedy)
        bound = self._full_bound.get(key)
        if bound is None:
            bound = self._full_bound[key] = full_window_bound(self.seconds_window(b), b, cfg, greedy=greedy,
                                                              tiers=self.tiers or None)
        window = budget_from.values[:, cfg.floor - 1: cfg.cap - 1]
        if bound > 1.0 or not window.size or not window.min() >= bound:  # no survival exceeds 1
            return False
        return budget_from is live or bool(live.values[:, cfg.floor - 1: cfg.cap - 1].min() >= cfg.survival_eps)

    def _placement(self, logits: Tensor) -> tuple[bool, bool]:
        """Where this step's small tensors are computed, decided once per step (the only host-path choice of the
        plan stage, `dispatch.use_host`): (survival on the host, budget + allocation + layout on the host).
        CPU logits take the numpy host path throughout; an accelerator's step is planned on the host (one read
        of its survival) when B * gamma <= HOST_PLAN_MAX, at lag 0 and without TP/DP agreement."""
        host = dispatch.use_host(logits)
        small = self.ring is None and self.parallel is None and logits.numel() <= HOST_PLAN_MAX
        return host, host or (small and dispatch.use_host())

    def _check_step(self, logits: Tensor, slots: Tensor, generations: Tensor) -> int:
        """The step's inputs: logits [B, gamma] of the config's gamma, and with a ring slots / generations [B]
        (their values by the ring's `check`); the cost model's platform once per device type. Returns B."""
        if _check_matrix("logits", logits).shape[1] != self.cfg.gamma:
            raise ValueError(f"logits must be [B, gamma={self.cfg.gamma}], got shape {tuple(logits.shape)}")
        b = logits.shape[0]
        if self.ring is not None:
            for name, v in (("slots", slots), ("generations", generations)):
                if check_tensor(name, v).shape != (b,):
                    raise ValueError(f"{name} must be [B={b}] (one per request of logits {tuple(logits.shape)}), "
                                     f"got shape {tuple(v.shape)}")
            self.ring.check(slots, generations)
        if logits.device.type != self._platform_seen:  # the run's platform: where its logits live
            check_cost_model(self.cost_model, platform=logits.device.type)
            self._platform_seen = logits.device.type
        return b

    def seconds_window(self, b: int) -> np.ndarray:
        """float64 host [B * C + 1]: T(B, B * F + budget) for every budget of a batch of B under this planner's
        cost model, computed once per B."""
        seconds = self._seconds_window_by_b.get(b)
        if seconds is None:
            seconds = self._seconds_window_by_b[b] = seconds_over_window(self.cost_model, b, self.cfg).numpy()
        return seconds

    def filled_seconds_window(self, b: int) -> list[float]:
        """`seconds_window(b)` with each tier's padding shared out (`filled_tier_seconds`: the allocation fills a
        tier's free rows), host floats [B * C + 1] (read one at a time, by the adaptive policy), computed once per B."""
        seconds = self._filled_window_by_b.get(b)
        if seconds is None:
            seconds = self._filled_window_by_b[b] = filled_tier_seconds(self.seconds_window(b)).tolist()
        return seconds

    def _device_tiers(self, device: torch.device) -> Tensor | None:
        """The tiers as an int64 tensor on `device` (the traced greedy scan's runs), made once per device."""
        if not self.tiers:
            return None
        if device not in self._tier_tensors:
            self._tier_tensors[device] = torch.tensor(self.tiers, dtype=torch.int64, device=device)
        return self._tier_tensors[device]

    def _device_decision(self, live: Tensor, lagged: Tensor | None) -> tuple[BudgetDecision, int, int]:
        """The decision on the device (the argmax over lagged survival, or at lag 0 the greedy scan over live
        survival, or its argmax with `live_argmax`); its budget and the live candidate count, brought to the host
        in one read."""
        b = live.shape[0]
        key = (b, live.device)
        if key not in self._seconds:
            self._seconds[key] = seconds_over_window(self.cost_model, b, self.cfg).to(live.device)
        seconds = self._seconds[key]
        cfg = self.cfg
        traced = traced_decision(live if lagged is None else lagged, seconds, cfg, greedy=self._scan,
                                 tiers=self._device_tiers(live.device))
        live_valid = (live[:, cfg.floor - 1: cfg.cap - 1] >= cfg.survival_eps).sum()
        budget, valid = boundary.to_host(torch.stack([traced.budget, live_valid])).tolist()
        return traced, budget, valid

    def _plan_sync_free(self, survival: Tensor, slots: Tensor, generations: Tensor, host: bool) -> VerifyPlan:
        """lag >= 1 without a device read: the budget from the host copy of the ring row this step reads."""
        lagged = self._next_row.read(slots, generations)
        self.ring._write(slots, generations, survival)
        self._next_row = self.ring.next_row_to_host()
        b, cfg = survival.shape[0], self.cfg
        budget, curves = host_choice(HostSurvival(lagged), self.cost_model, cfg, seconds=self.seconds_window(b))
        offered, tier = tier_fill(budget, b, cfg.floor, self.tiers)
        verify_lens = _allocate(survival, offered, cfg)
        # no tier fixes the rows: the layout reads its total (the step's one read)
        layout = RaggedVerifyLayout._from_lens(verify_lens, self.tiers, self.graph_slots, cfg.width, graph_rows=tier,
                                               host=host)
        executed = None if layout.total_rows is None else layout.total_rows - b * cfg.floor
        return VerifyPlan(verify_lens, layout, functools.partial(curves_decision, budget, curves), survival, executed,
                          offered, float(self.seconds_window(b)[budget]))
