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
from dspark.kernels import topk
from dspark.plan.budget import HostSurvival, candidate_window, check_config, plan_on_host


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


def allocate_verify_lens(survival: Tensor | HostSurvival, budget: int, cfg: ScheduleConfig) -> Tensor:
    """[B] int32 verify lengths in [F, M_max]: F plus the request's share of the global top-`budget`.

    One entry point, two backends: a step planned on the host (`plan_on_host`: CPU tensors, or the
    step's `HostSurvival`) runs the numpy radix select and returns a CPU tensor; otherwise the Triton
    kernel runs on the survival's device. Both equal the torch reference (`dspark.kernels.topk`)."""
    k = check_budget(budget)
    cfg = check_config(cfg)
    host = survival if isinstance(survival, HostSurvival) else plan_on_host(survival, cfg)
    if host is not None:
        return topk.verify_lens_host(host.values, k, cfg.floor, cfg.cap, cfg.survival_eps)
    s, _ = candidate_window(survival, cfg)
    return topk.verify_lens(s.contiguous(), k, cfg.floor, cfg.cap, cfg.survival_eps)
