"""Agreement across tensor- and data-parallel ranks on torch.distributed (DESIGN.md 4.10): the planner's
view (`ParallelAgreement`) and the start-up cost-table check.

In production the planner runs on every rank. Two TP ranks holding different `verify_lens`, or two DP
ranks replaying different graph tiers, issue collectives of different shapes and hang; `dspark.parallel.tp`
and `dspark.parallel.dp` make the per-step agreement explicit and cheap and turn every disagreement into an
error naming the ranks. `check_cost_table` / `check_planning_config`: the budget is computed from
replicated inputs (lagged survival, same cost table, same schedule, tiers, graph slots, temperatures and
lag), so ranks agree without a per-step collective; the table's fingerprint and every other planning
setting are compared once at start-up. `EstimatorAgreement`: the online acceptance estimator's parameters, agreed at every refit.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from dspark.parallel.dp import DpTierAgreement
from dspark.parallel.tp import (
    AgreementError,
    CostTableMismatchError,
    ParallelConfig,
    PlanningConfigMismatchError,
    TpAgreement,
    by_value,
    collective_device,
    group_ranks,
)


def check_cost_table(group: dist.ProcessGroup | None, fingerprint: str) -> None:
    """Start-up check: every rank of `group` must hold the same cost-table fingerprint.

    Collective (all ranks call it). On a mismatch every rank raises `CostTableMismatchError` naming the
    ranks and both fingerprints, so a rank restarted with another table is refused instead of
    silently planning different budgets (which would then hang the TP forward).
    """
    check_fingerprint(group, fingerprint, what="cost table", error=CostTableMismatchError,
                      fix="Load the same cost table on every rank: the budget is computed locally from "
                          "replicated inputs and must match.")


def _gather(group: dist.ProcessGroup | None, value: object) -> tuple[list[int], list[object], list[int]]:
    """(the group's ranks, every rank's `value`, the ranks whose value differs from the first rank's);
    collective, skipped on a one-rank group."""
    ranks = group_ranks(group)
    if len(ranks) == 1:
        return ranks, [value], []
    gathered: list[object] = [None] * len(ranks)
    dist.all_gather_object(gathered, value, group=group)
    return ranks, gathered, [r for r, v in zip(ranks, gathered) if v != gathered[0]]


def check_fingerprint(group: dist.ProcessGroup | None, fingerprint: str, *, what: str,
                      error: type[AgreementError] = AgreementError, fix: str = "") -> None:
    """Start-up check that every rank of `group` holds the same `fingerprint` of `what` (a cost table, an
    estimator configuration); collective; on a mismatch every rank raises `error` naming the ranks."""
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"fingerprint must be a non-empty str, got {fingerprint!r}")
    ranks, gathered, differ = _gather(group, fingerprint)
    if not differ:
        return
    ref = gathered[0]
    me = dist.get_rank()
    who = (
        f"rank {me} is refused: its {what} {fingerprint} differs from {ref} (rank {ranks[0]})"
        if fingerprint != ref else f"rank {me} holds the group's {what} {ref}"
    )
    detail = "; ".join(f"ranks {rs} have {f}" for f, rs in by_value(gathered, ranks).items())
    raise error(f"{what} fingerprints differ across ranks ({detail}); {who}. {fix}".rstrip(), differ)


def check_planning_config(group: dist.ProcessGroup | None, config: Mapping[str, str]) -> None:
    """Start-up check: every rank of `group` must plan with the same settings.

    Args:
        group: the TP or DP group (collective: all its ranks call it).
        config: setting name -> its canonical value as a str (`VerifyPlanner.planning_config`).
    Raises:
        PlanningConfigMismatchError on every rank, naming each setting that differs and which ranks hold
        which value; `ranks` are the ranks that differ from the group's first.
    """
    if not isinstance(config, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in config.items()):
        raise TypeError(f"config must map setting names to str values, got {config!r}")
    ranks, gathered, differ = _gather(group, dict(config))
    if not differ:
        return
    names = sorted({k for c in gathered for k in c if any(c.get(k) != o.get(k) for o in gathered)})
    detail = "; ".join(
        f"{name}: " + ", ".join(f"ranks {rs} have {v}" for v, rs in
                                by_value([c.get(name, "<unset>") for c in gathered], ranks).items())
        for name in names)
    raise PlanningConfigMismatchError(
        f"planning configurations differ across ranks in {', '.join(names)} ({detail}); rank {dist.get_rank()} "
        f"{'is refused' if dist.get_rank() in differ else 'holds the group configuration'}. Build the planner "
        f"with the same ScheduleConfig, tiers, graph_slots, temperatures and lag on every rank: a rank planning "
        f"differently picks other budgets or tiers and hangs the next collective.", differ)


class EstimatorAgreement:
    """Identical online-estimator parameters on every rank of the TP group (`dspark.calibration.online`).

    At construction the estimator's configuration fingerprint is compared (a rank refitting at other steps
    would leave the others waiting in a collective). `agree` runs at every refit: the float64 parameters
    travel as their int32 bit pattern through `TpAgreement`, so tp_mode "broadcast" sends the first rank's
    parameters bit for bit (the first rank is authoritative) and "verify" hash-checks the local fits and
    raises `TpDisagreementError` naming the ranks whose accumulators drifted.
    """

    def __init__(self, config: ParallelConfig, *, fingerprint: str):
        self.config = config
        self.tp = TpAgreement(config.tp_group, config.tp_mode, what="online estimator parameters")
        check_fingerprint(config.tp_group, fingerprint, what="online estimator configuration",
                          fix="Build the estimator with the same arguments on every TP rank.")

    def agree(self, parameters: Tensor) -> Tensor:
        """The group's parameters (same shape and dtype, on the input's device)."""
        if not isinstance(parameters, Tensor) or parameters.dtype != torch.float64 or parameters.dim() != 2:
            raise TypeError(f"parameters must be a 2-D float64 tensor, got {getattr(parameters, 'dtype', parameters)}")
        bits = parameters.contiguous().view(torch.int32).reshape(-1)
        agreed = self.tp.agree(bits.to(collective_device(self.config.tp_group)))
        return agreed.to(parameters.device).reshape(parameters.shape[0], -1).view(torch.float64)


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
        planning: Mapping[str, str] | None = None,
    ):
        self.config = config
        self.tp = TpAgreement(config.tp_group, config.tp_mode) if config.tp_group is not None else None
        self.dp = (
            DpTierAgreement(config.dp_group, tiers, slots, width) if config.dp_group is not None else None
        )
        for group in {id(g): g for g in (config.tp_group, config.dp_group) if g is not None}.values():
            check_cost_table(group, fingerprint)
            if planning is not None:
                check_planning_config(group, planning)

    def verify_lens(self, verify_lens: Tensor) -> Tensor:
        """TP-agreed lens (unchanged without a TP group)."""
        return self.tp.agree(verify_lens) if self.tp is not None else verify_lens
