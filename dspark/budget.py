"""The global verify budget: tau(b), T(B, M(b)) and theta(b) = tau(b) / T over every budget b at once.

With floor F and cap M_max (DESIGN.md 4.2) every request verifies its root and drafts 0..F-2; the
candidates are draft columns j in [F-1, M_max-2] with survival >= survival_eps, ranked globally by
survival (DESIGN.md 4.3). Then

    tau(b)  = sum_r (1 + sum_{j < F-1} s[r, j]) + (sum of the b best candidates)
    rows(b) = B * F + b,   theta(b) = tau(b) / T(B, rows(b)),   b in [0, #candidates].

`choose_budget` takes the argmax of theta (ties to the smaller b). Callers hand it survival at least
one step old (lagged) so that admitting a draft never depends on that draft's own value
(non-anticipation, DESIGN.md 4.4); `greedy_budget` is the synchronous alternative.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dspark.config import ScheduleConfig
from dspark.cost import CostModel
from dspark.survival import monotone_survival


def check_config(cfg: object) -> ScheduleConfig:
    if not isinstance(cfg, ScheduleConfig):
        raise TypeError(f"cfg must be a ScheduleConfig, got {type(cfg).__name__}: {cfg!r}")
    return cfg


def candidate_window(survival: Tensor, cfg: ScheduleConfig) -> tuple[Tensor, Tensor, Tensor]:
    """(monotone survival [B, gamma], candidates [B, C], valid [B, C]) for the window of DESIGN.md 4.2.

    Survival is made non-increasing along positions first (NaN -> 0), so every request's valid
    candidates form a prefix of its window.
    """
    cfg = check_config(cfg)
    s = monotone_survival(survival)
    if s.shape[1] != cfg.gamma:
        raise ValueError(f"survival must be [B, gamma={cfg.gamma}], got shape {tuple(s.shape)}")
    cand = s[:, cfg.floor - 1: cfg.cap - 1]
    return s, cand, cand >= cfg.survival_eps


def floor_tau(s: Tensor, cfg: ScheduleConfig) -> Tensor:
    """float64 scalar: sum over requests of the root plus the drafts the floor verifies."""
    return s.shape[0] + s[:, : cfg.floor - 1].to(torch.float64).sum()


@dataclass(frozen=True)
class _Curves:
    tau: Tensor            # [n + 1] float64, n = B * C (entries past num_candidates repeat the last)
    num_candidates: Tensor  # int64 scalar: valid candidates


def _curves(survival: Tensor, cfg: ScheduleConfig) -> _Curves:
    s, cand, valid = candidate_window(survival, cfg)
    flat = torch.where(valid, cand, torch.zeros_like(cand)).reshape(-1)
    best = torch.sort(flat, descending=True).values.to(torch.float64)
    tau = torch.cat([floor_tau(s, cfg).reshape(1), best]).cumsum(0)
    return _Curves(tau, valid.sum())


def tau_curve(survival: Tensor, cfg: ScheduleConfig) -> Tensor:
    """tau(b) for b = 0..#candidates, float64 [#candidates + 1] (one vectorized pass)."""
    c = _curves(survival, cfg)
    return c.tau[: int(c.num_candidates) + 1]


@dataclass(frozen=True)
class BudgetDecision:
    """The chosen budget, its verify rows and predicted tau, step seconds and theta; whole curves for plots."""

    budget: int
    tau: float
    step_seconds: float
    theta: float
    rows: int                   # B * F + budget
    tau_curve: Tensor           # [#candidates + 1] float64, index = b
    step_seconds_curve: Tensor  # [#candidates + 1] float64
    theta_curve: Tensor         # [#candidates + 1] float64

    @property
    def rows_curve(self) -> Tensor:
        """Verify rows B * F + b for each budget b of the curves."""
        return self.rows - self.budget + torch.arange(self.tau_curve.numel(), dtype=torch.int64)


def _theta(survival: Tensor, cost_model: CostModel, cfg: ScheduleConfig) -> tuple[_Curves, Tensor, Tensor]:
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
    curves = _curves(survival, cfg)
    b = survival.shape[0]
    rows = b * cfg.floor + torch.arange(curves.tau.numel(), dtype=torch.int64, device=curves.tau.device)
    seconds = cost_model.step_seconds(b, rows)
    theta = curves.tau / seconds
    return curves, seconds, theta


def _decide(curves: _Curves, seconds: Tensor, theta: Tensor, pick: Tensor, b: int, cfg: ScheduleConfig) -> BudgetDecision:
    """One host sync: the picked budget and the number of candidates."""
    budget, n = (int(v) for v in torch.stack([pick, curves.num_candidates]).tolist())
    tau, sec, th = (float(v) for v in torch.stack([curves.tau[budget], seconds[budget], theta[budget]]).tolist())
    return BudgetDecision(budget, tau, sec, th, b * cfg.floor + budget, curves.tau[: n + 1],
                          seconds[: n + 1], theta[: n + 1])


def choose_budget(survival: Tensor, cost_model: CostModel, cfg: ScheduleConfig) -> BudgetDecision:
    """argmax_b theta(b) over b in [0, #candidates], ties to the smaller b (hand in lagged survival)."""
    curves, seconds, theta = _theta(survival, cost_model, cfg)
    idx = torch.arange(theta.numel(), device=theta.device)
    masked = torch.where(idx <= curves.num_candidates, theta, torch.full_like(theta, -torch.inf))
    return _decide(curves, seconds, theta, torch.argmax(masked), survival.shape[0], cfg)


def greedy_budget(survival: Tensor, cost_model: CostModel, cfg: ScheduleConfig) -> BudgetDecision:
    """Synchronous (lag = 0) budget: admit candidates best-first while theta strictly rises.

    Equals the sequential scan that stops at the first b with theta(b + 1) <= theta(b) (evaluated
    vectorized). Caveat: the stop test at b reads the (b+1)-th candidate's own survival, so this is
    non-anticipating only to the extent the survival of a draft is fixed before its token is known;
    it may also stop at a local maximum below the free argmax. Use lag >= 1 for the strict guarantee.
    """
    curves, seconds, theta = _theta(survival, cost_model, cfg)
    idx = torch.arange(theta.numel(), device=theta.device)
    rises = torch.cat([theta[1:] > theta[:-1], torch.zeros(1, dtype=torch.bool, device=theta.device)])
    go_on = rises & (idx < curves.num_candidates)
    pick = torch.where(go_on, torch.full_like(idx, theta.numel()), idx).min()
    return _decide(curves, seconds, theta, pick, survival.shape[0], cfg)


def expected_commit(survival: Tensor, verify_lens: Tensor, cfg: ScheduleConfig) -> float:
    """tau of a given allocation: sum_r (1 + sum_{j < verify_lens[r] - 1} s[r, j]) (E[sum commit_lens])."""
    s, _, _ = candidate_window(survival, cfg)
    if not isinstance(verify_lens, Tensor):
        raise TypeError(f"verify_lens must be a tensor, got {type(verify_lens).__name__}")
    if verify_lens.dtype.is_floating_point or verify_lens.dtype == torch.bool:
        raise TypeError(f"verify_lens must be an integer tensor, got dtype {verify_lens.dtype}")
    if tuple(verify_lens.shape) != (s.shape[0],):
        raise ValueError(f"verify_lens must be [B={s.shape[0]}], got shape {tuple(verify_lens.shape)}")
    vl = verify_lens.to(s.device, torch.int64)
    bad = (vl < 1) | (vl > cfg.width)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"verify_lens[{i}] = {int(vl[i])} is outside [1, W={cfg.width}]")
    cols = torch.arange(cfg.gamma, device=s.device)
    verified = cols.unsqueeze(0) < (vl - 1).unsqueeze(1)
    return float(s.shape[0] + torch.where(verified, s, torch.zeros_like(s)).to(torch.float64).sum())
