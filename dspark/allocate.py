"""verify_lens from survival and a global budget: the global top-k of DESIGN.md 4.3.

The best `budget` candidates (survival desc, then draft position asc, then request asc; never one below
survival_eps or NaN) each add one verify row to their request on top of the floor F. Survival handed in
is first made non-increasing along positions, so each request's selection is a prefix of its drafts and
`sum(verify_lens - F) <= budget`.
"""
from __future__ import annotations

import operator

import numpy as np
from torch import Tensor

from dspark.budget import candidate_window, host_survival
from dspark.config import ScheduleConfig
from dspark.kernels import dispatch, topk


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


def allocate_verify_lens_host(host: np.ndarray, budget: int, cfg: ScheduleConfig) -> Tensor:
    """`allocate_verify_lens` of survival already on the host (float32 numpy [B, gamma], non-increasing
    along positions, NaN-free: see `dspark.budget.greedy_budget_host`); [B] int32 on the CPU."""
    return topk.verify_lens_host(host, check_budget(budget), cfg.floor, cfg.cap, cfg.survival_eps)


def allocate_verify_lens(survival: Tensor, budget: int, cfg: ScheduleConfig) -> Tensor:
    """[B] int32 verify lengths in [F, M_max]: F plus the request's share of the global top-`budget`."""
    if isinstance(survival, Tensor) and dispatch.use_host(survival):
        return allocate_verify_lens_host(host_survival(survival, cfg), budget, cfg)
    k = check_budget(budget)
    s, _ = candidate_window(survival, cfg)
    return topk.verify_lens(s.contiguous(), k, cfg.floor, cfg.cap, cfg.survival_eps)
