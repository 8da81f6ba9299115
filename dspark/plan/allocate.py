"""verify_lens from survival and a global budget: the global top-k of DESIGN.md 4.3.

The best `budget` candidates (survival desc, then draft position asc, then request asc; never one below
survival_eps or NaN) each add one verify row to their request on top of the floor F. Survival handed in
is first made non-increasing along positions, so each request's selection is a prefix of its drafts and
`sum(verify_lens - F) <= budget`.
"""
from __future__ import annotations

import operator

from torch import Tensor

from dspark.config import ScheduleConfig
from dspark.kernels import dispatch, topk
from dspark.plan.budget import HostSurvival, _check_survival, check_config
from dspark.plan.survival import monotone_survival


def check_budget(budget: object) -> int:
    """A budget is an int >= 0 (extra verify rows beyond every request's floor)."""
    if isinstance(budget, bool):
        raise TypeError(f"budget must be an int, got {budget!r}")
    try:
        value = operator.index(budget)
    except TypeError:
        raise TypeError(f"budget must be an int, got {budget!r} ({type(budget).__name__})") from None
    if value < 0:
        raise ValueError(f"budget must be >= 0, got {value}")
    return value


def allocate_verify_lens(survival: Tensor | HostSurvival, budget: int | Tensor, cfg: ScheduleConfig) -> Tensor:
    """Verify lengths: F plus each request's share of the global top-`budget` candidates.

    Args:
        survival: floating [B, gamma] (made non-increasing first, NaN -> 0), or a `HostSurvival` (the
            host fast path a planner chose).
        budget: int >= 0; inside `torch.compile` also a 0-d integer tensor (a traced `choose_budget`'s).
        cfg: the schedule.
    Returns:
        [B] int32 in [F, M_max]: on the survival's device, or a CPU tensor for a `HostSurvival`.
    """
    cfg = check_config(cfg)
    _check_survival(survival, cfg)
    if not (dispatch.tracing() and isinstance(budget, Tensor)):
        budget = check_budget(budget)
    return _allocate(survival if isinstance(survival, HostSurvival) else monotone_survival(survival), budget, cfg)


def _allocate(survival: Tensor | HostSurvival, budget: int | Tensor, cfg: ScheduleConfig) -> Tensor:
    """`allocate_verify_lens` without checks or repair.

    Args:
        survival: the step's `HostSurvival` (the numpy host path, its sorted window reused), or a
            [B, gamma] non-increasing NaN-free tensor (calibrated or `monotone_survival`): the Triton
            kernel on accelerators, the torch reference elsewhere and inside `torch.compile`.
        budget: int >= 0 (or a 0-d tensor on the tensor path).
        cfg: the schedule.
    Returns:
        [B] int32, as `allocate_verify_lens`.
    """
    if isinstance(survival, HostSurvival):
        return topk.verify_lens_host(survival.values, budget, cfg.floor, cfg.cap, cfg.survival_eps,
                                     ranked=survival.window(cfg)[0])
    return topk.verify_lens(survival.contiguous(), budget, cfg.floor, cfg.cap, cfg.survival_eps)
