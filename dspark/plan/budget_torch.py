"""The budget's torch formulas: tau, theta and their argmax / greedy scan over every budget at once, and tau of
a given allocation. Static shapes, no host read, no data-dependent branch: the path inside `torch.compile` and
for a planner's device steps (`dspark.plan.budget` adds the host path and the checked public functions).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class DeviceCurves(NamedTuple):
    """`theta_curves_torch`'s result: device tensors, nothing read to the host."""

    budget: Tensor      # 0-d int64: argmax_b theta(b), ties to the smaller b
    greedy: Tensor      # 0-d int64: `greedy_budget`'s scan over runs of equal predicted seconds
    num_valid: Tensor   # 0-d int64: #candidates (survival >= eps)
    tau: Tensor         # [B * C + 1] float64 (entries past num_valid repeat tau(num_valid))
    theta: Tensor       # [B * C + 1] float64, -inf past num_valid


def theta_curves_torch(survival: Tensor, seconds: Tensor, floor: int, cap: int, eps: float,
                       tiers: Tensor | None = None) -> DeviceCurves:
    """The device-side budget: tau, theta and their argmax over every budget b = 0..B * C at once.

    Args:
        survival: monotone [B, gamma] (`monotone_survival` / calibrated).
        seconds: float64 [B * C + 1] = T(B, B * F + b) on the same device.
        floor, cap, eps: F, M_max, survival_eps.
        tiers: int64 [T] ascending graph tiers (the greedy scan's runs), or None (runs of equal seconds).
    Returns:
        DeviceCurves. Budgets past #candidates get theta = -inf, so the static length B * C + 1 replaces the
        data-dependent one: no host read, no data-dependent branch.
    """
    tau, num_valid = _tau_torch(survival, floor, cap, eps)
    b = torch.arange(tau.numel(), device=tau.device)
    theta = torch.where(b <= num_valid, tau / seconds, float("-inf"))
    if tiers is None:
        key = seconds
    else:
        rows = survival.shape[0] * floor + b
        key = torch.where(rows > tiers[-1], rows + tiers.numel(), torch.searchsorted(tiers, rows))
    return DeviceCurves(torch.argmax(theta), _greedy_over_runs(theta, key, num_valid), num_valid, tau, theta)


def _tau_torch(survival: Tensor, floor: int, cap: int, eps: float) -> tuple[Tensor, Tensor]:
    """(tau [B * C + 1] float64, #candidates 0-d int64): the best candidates first, invalid ones as zeros
    sorted last, so tau past #candidates repeats tau(#candidates)."""
    cand = survival[:, floor - 1: cap - 1]
    valid = cand >= eps
    best = torch.sort(torch.where(valid, cand, 0.0).reshape(-1).to(torch.float64), descending=True).values
    base = survival.shape[0] + survival[:, : floor - 1].to(torch.float64).sum()
    return base + torch.cat([best.new_zeros(1), torch.cumsum(best, 0)]), valid.sum().to(torch.int64)


def _greedy_over_runs(theta: Tensor, key: Tensor, num_valid: Tensor) -> Tensor:
    """`greedy_budget`'s scan on the device: the last budget of the first run (budgets of equal `key`: one
    tier, or equal predicted seconds) whose next run's theta does not exceed its own (runs past num_valid do
    not exist: theta -inf)."""
    b = torch.arange(theta.numel(), device=theta.device)
    differs = torch.cat([key[1:] != key[:-1], torch.ones(1, dtype=torch.bool, device=theta.device)])
    is_end = (b <= num_valid) & (differs | (b == num_valid))
    run = torch.cumsum(is_end.to(torch.int64), 0) - is_end.to(torch.int64)  # index of the run b belongs to
    run_theta = torch.full((theta.numel() + 1,), float("-inf"), dtype=theta.dtype, device=theta.device)
    run_theta = run_theta.scatter_reduce(0, run, torch.where(is_end, theta, float("-inf")), "amax")
    run_end = torch.full((theta.numel() + 1,), -1, dtype=torch.int64, device=theta.device)
    run_end = run_end.scatter_reduce(0, run, torch.where(is_end, b, -1), "amax")
    stops = run_theta[1:] <= run_theta[:-1]
    return run_end.index_select(0, torch.argmax(stops.to(torch.int8)).reshape(1)).squeeze(0)  # no host read


def expected_commit_torch(survival: Tensor, verify_lens: Tensor) -> Tensor:
    """tau of an allocation, without checks: sum_r (1 + sum_{j < verify_lens[r] - 1} s[r, j]).

    Args:
        survival: [B, gamma] non-increasing, NaN-free (`monotone_survival` / calibrated).
        verify_lens: [B] integer in [1, W].
    Returns:
        0-d float64 tensor on the survival's device (no host read).
    """
    cols = torch.arange(survival.shape[1], device=survival.device)
    verified = cols.unsqueeze(0) < (verify_lens.to(survival.device, torch.int64) - 1).unsqueeze(1)
    return survival.shape[0] + torch.where(verified, survival, torch.zeros_like(survival)).to(torch.float64).sum()
