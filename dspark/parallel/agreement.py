"""Agreement across tensor- and data-parallel ranks on torch.distributed (DESIGN.md 4.10): the planner's
view (`ParallelAgreement`) and the start-up cost-table check.

In production the planner runs on every rank. Two TP ranks holding different `verify_lens`, or two DP
ranks replaying different graph tiers, issue collectives of different shapes and hang; `dspark.parallel.tp`
and `dspark.parallel.dp` make the per-step agreement explicit and cheap and turn every disagreement into an
error naming the ranks. `check_cost_table`: the budget is computed from replicated inputs (lagged survival,
same cost table), so ranks agree without a per-step collective; the table's fingerprint is compared once
at start-up.
"""
from __future__ import annotations

from typing import Sequence

import torch.distributed as dist
from torch import Tensor

from dspark.parallel.dp import DpTierAgreement
from dspark.parallel.tp import CostTableMismatchError, ParallelConfig, TpAgreement, by_value, group_ranks


def check_cost_table(group: dist.ProcessGroup | None, fingerprint: str) -> None:
    """Start-up check: every rank of `group` must hold the same cost-table fingerprint.

    Collective (all ranks call it). On a mismatch every rank raises `CostTableMismatchError` naming the
    ranks and both fingerprints, so a rank restarted with another table is refused instead of
    silently planning different budgets (which would then hang the TP forward).
    """
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"fingerprint must be a non-empty str, got {fingerprint!r}")
    ranks = group_ranks(group)
    if len(ranks) == 1:
        return
    gathered: list[object] = [None] * len(ranks)
    dist.all_gather_object(gathered, fingerprint, group=group)
    ref = gathered[0]
    differ = [r for r, f in zip(ranks, gathered) if f != ref]
    if not differ:
        return
    me = dist.get_rank()
    who = (
        f"rank {me} is refused: its cost table {fingerprint} differs from {ref} (rank {ranks[0]})"
        if fingerprint != ref else f"rank {me} holds the group's table {ref}"
    )
    detail = "; ".join(f"ranks {rs} have {f}" for f, rs in by_value(gathered, ranks).items())
    raise CostTableMismatchError(
        f"cost table fingerprints differ across ranks ({detail}); {who}. Load the same cost table on "
        "every rank: the budget is computed locally from replicated inputs and must match.",
        differ,
    )


class ParallelAgreement:
    """The planner's view: the start-up check, then per step `verify_lens` (TP) and `dp.step` (DP)."""

    def __init__(
        self,
        config: ParallelConfig,
        *,
        fingerprint: str,
        tiers: Sequence[int] | None = None,
        slots: int | None = None,
        width: int | None = None,
    ):
        self.config = config
        self.tp = TpAgreement(config.tp_group, config.tp_mode) if config.tp_group is not None else None
        self.dp = (
            DpTierAgreement(config.dp_group, tiers, slots, width) if config.dp_group is not None else None
        )
        for group in {id(g): g for g in (config.tp_group, config.dp_group) if g is not None}.values():
            check_cost_table(group, fingerprint)

    def verify_lens(self, verify_lens: Tensor) -> Tensor:
        """TP-agreed lens (unchanged without a TP group)."""
        return self.tp.agree(verify_lens) if self.tp is not None else verify_lens
