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
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from dspark.config import ScheduleConfig
from dspark.cost import CostModel, check_cost_model
from dspark.kernels import dispatch
from dspark.plan.survival import _check_matrix, monotone_survival
from dspark.util.validate import check_verify_lens
from dspark.verify import boundary


def check_config(cfg: object) -> ScheduleConfig:
    if not isinstance(cfg, ScheduleConfig):
        raise TypeError(f"cfg must be a ScheduleConfig, got {type(cfg).__name__}: {cfg!r}")
    return cfg


def _check_survival(survival: Tensor, cfg: ScheduleConfig) -> ScheduleConfig:
    cfg = check_config(cfg)
    _check_matrix("survival", survival)
    if survival.shape[1] != cfg.gamma:
        raise ValueError(f"survival must be [B, gamma={cfg.gamma}], got shape {tuple(survival.shape)}")
    return cfg


def candidate_window(survival: Tensor, cfg: ScheduleConfig) -> tuple[Tensor, Tensor]:
    """(monotone survival [B, gamma], candidates [B, C]) for the window of DESIGN.md 4.2.

    Survival is made non-increasing along positions first (NaN -> 0), so every request's valid
    candidates form a prefix of its window.
    """
    cfg = _check_survival(survival, cfg)
    s = monotone_survival(survival)
    return s, s[:, cfg.floor - 1: cfg.cap - 1]


HOST_PLAN_MAX = 16384  # survival entries (B * gamma) up to which an accelerator's step may be planned on the host


@dataclass(frozen=True)
class HostSurvival:
    """One step's survival on the host: float32 numpy [B, gamma], non-increasing along positions, NaN-free.

    The budget scan and the allocation both take it in place of the tensor, so a step planned on the host
    pays one device-to-host copy; small numpy arrays then cost far less per call than a chain of torch
    ops (perf/planner_bench.py)."""

    values: np.ndarray


def host_survival(survival: Tensor, cfg: ScheduleConfig) -> np.ndarray:
    """`monotone_survival` copied to the host: float32 numpy [B, gamma] (the budget is an int: its curves
    are computed on the host whatever the device)."""
    _check_survival(survival, cfg)
    return boundary.to_host(monotone_survival(survival))


def plan_on_host(survival: Tensor, cfg: ScheduleConfig, *, calibrated: bool = False,
                 small_batches: bool = False) -> HostSurvival | None:
    """Where a step is planned, decided once: the host copy when it is planned on the host, else None
    (the allocation then runs on the survival's device).

    CPU tensors are planned on the host. An accelerator's step is too when `small_batches` allows it
    (the planner's lag-0 steps without TP/DP agreement: their budget reads the survival on the host
    anyway) and B * gamma <= HOST_PLAN_MAX, so the allocation and layout cost a few numpy calls instead
    of a chain of kernel launches. `calibrated`: the survival is `calibrated_survival`'s, already
    non-increasing and NaN-free bit for bit, so no running minimum is taken."""
    _check_survival(survival, cfg)
    on_host = dispatch.use_host(survival) or (small_batches and dispatch.backend() == "auto"
                                              and survival.numel() <= HOST_PLAN_MAX)
    if not on_host:
        return None
    return HostSurvival(boundary.to_host(survival) if calibrated else host_survival(survival, cfg))


def _host_values(survival: Tensor | HostSurvival, cfg: ScheduleConfig) -> np.ndarray:
    if isinstance(survival, HostSurvival):
        if survival.values.ndim != 2 or survival.values.shape[1] != cfg.gamma:
            raise ValueError(f"survival must be [B, gamma={cfg.gamma}], got shape {survival.values.shape}")
        return survival.values
    return host_survival(survival, cfg)


@dataclass(frozen=True)
class _Curves:
    """Host (numpy) float64 curves over b = 0..#candidates."""

    base: int  # B * F: rows at b = 0
    tau: np.ndarray
    seconds: np.ndarray | None = None
    theta: np.ndarray | None = None


def _host_curves(survival: Tensor, cost_model: CostModel | None, cfg: ScheduleConfig) -> _Curves:
    """Curves from `host_survival`: a values-only numpy sort (about ten times faster than torch.sort at
    planner sizes on the CPU) and sequential float64 prefix sums."""
    return _curves(host_survival(survival, cfg), cost_model, cfg)


def _curves(host: np.ndarray, cost_model: CostModel | None, cfg: ScheduleConfig) -> _Curves:
    cand = host[:, cfg.floor - 1: cfg.cap - 1]
    valid = cand >= cfg.survival_eps
    n = int(np.count_nonzero(valid))
    best = np.sort(np.where(valid, cand, np.float32(0)), axis=None).astype(np.float64)[: -n - 1: -1]
    floor = host.shape[0] + (host[:, : cfg.floor - 1].sum(dtype=np.float64) if cfg.floor > 1 else 0.0)
    tau = np.empty(n + 1)
    tau[0] = 0.0
    np.cumsum(best, out=tau[1:])
    tau += floor
    base = host.shape[0] * cfg.floor
    if cost_model is None:
        return _Curves(base, tau)
    seconds = cost_model.seconds_curve(host.shape[0], base, n + 1)
    return _Curves(base, tau, seconds, tau / seconds)


def tau_curve(survival: Tensor, cfg: ScheduleConfig) -> Tensor:
    """tau(b) for b = 0..#candidates: float64 [#candidates + 1] on the host (one vectorized pass)."""
    return torch.from_numpy(_host_curves(survival, None, cfg).tau)


@dataclass(frozen=True)
class BudgetDecision:
    """The chosen budget, its verify rows and predicted tau, step seconds and theta; whole curves for plots.

    The curves are float64 host tensors indexed by b = 0..#candidates.
    """

    budget: int
    tau: float
    step_seconds: float
    theta: float
    rows: int                   # B * F + budget
    tau_curve: Tensor
    step_seconds_curve: Tensor
    theta_curve: Tensor

    @property
    def rows_curve(self) -> Tensor:
        """Verify rows B * F + b for each budget b of the curves."""
        return self.rows - self.budget + torch.arange(self.tau_curve.numel(), dtype=torch.int64)


def _decide(c: _Curves, budget: int) -> BudgetDecision:
    return BudgetDecision(budget, float(c.tau[budget]), float(c.seconds[budget]), float(c.theta[budget]),
                          c.base + budget, torch.from_numpy(c.tau), torch.from_numpy(c.seconds),
                          torch.from_numpy(c.theta))


def choose_budget(survival: Tensor | HostSurvival, cost_model: CostModel, cfg: ScheduleConfig) -> BudgetDecision:
    """argmax_b theta(b) over b in [0, #candidates], ties to the smaller b (hand in lagged survival).

    The cost model must have been profiled at the config's W (`check_cost_model`). `survival` may be a
    `HostSurvival` already on the host (the sync-free planner's lagged ring row)."""
    cfg = check_config(cfg)
    c = _curves(_host_values(survival, cfg), check_cost_model(cost_model, width=cfg.width), cfg)
    return _decide(c, int(np.argmax(c.theta)))


def greedy_budget(survival: Tensor | HostSurvival, cost_model: CostModel, cfg: ScheduleConfig) -> BudgetDecision:
    """Synchronous (lag = 0) budget: admit candidates best-first while theta strictly rises.

    Candidates whose rows the cost model prices the same as the rows before them (a run of equal
    predicted seconds: one tier of a `TieredCostModel`, one bucket of a steps/s table) are admitted
    together, as one unit: their time is paid with the run's first row, and graph-tier fill adds them
    anyway. So this equals the sequential scan over the runs' last budgets that stops at the first run
    whose theta does not exceed the previous run's (evaluated vectorized); with a strictly increasing
    cost every run is one candidate. Caveat: the stop test reads the next run's own survivals, so this is
    non-anticipating only to the extent the survival of a draft is fixed before its token is known;
    it may also stop at a local maximum below the free argmax. Use lag >= 1 for the strict guarantee.
    `survival` may be the step's `HostSurvival` (`plan_on_host`).
    """
    cfg = check_config(cfg)
    c = _curves(_host_values(survival, cfg), check_cost_model(cost_model, width=cfg.width), cfg)
    ends = np.flatnonzero(np.append(c.seconds[1:] != c.seconds[:-1], True))  # last budget of each run
    stops = np.flatnonzero(c.theta[ends[1:]] <= c.theta[ends[:-1]])
    return _decide(c, int(ends[stops[0]] if stops.size else ends[-1]))


class DeviceCurves(NamedTuple):
    """`theta_curves_torch`'s result: device tensors, nothing read to the host."""

    budget: Tensor      # 0-d int64: argmax_b theta(b), ties to the smaller b
    greedy: Tensor      # 0-d int64: `greedy_budget`'s scan over runs of equal predicted seconds
    num_valid: Tensor   # 0-d int64: #candidates (survival >= eps)
    tau: Tensor         # [B * C + 1] float64 (entries past num_valid repeat tau(num_valid))
    theta: Tensor       # [B * C + 1] float64, -inf past num_valid


def theta_curves_torch(survival: Tensor, seconds: Tensor, floor: int, cap: int, eps: float) -> DeviceCurves:
    """The device-side budget: tau, theta and their argmax over every budget b = 0..B * C at once.

    survival: monotone [B, gamma] (`monotone_survival` / calibrated); seconds: float64 [B * C + 1] =
    T(B, B * F + b) on the same device (`seconds_over_window`). Same formulas as the host curves of
    `choose_budget` (sums in another order: equal to rounding). Budgets past #candidates get theta = -inf,
    so the static length B * C + 1 replaces the data-dependent one: no host read, no data-dependent
    branch (compiles with `fullgraph=True, dynamic=True`; tests/test_compile_verify_path.py)."""
    cand = survival[:, floor - 1: cap - 1]
    valid = cand >= eps
    best = torch.sort(torch.where(valid, cand, 0.0).reshape(-1).to(torch.float64), descending=True).values
    base = survival.shape[0] + survival[:, : floor - 1].to(torch.float64).sum()
    tau = base + torch.cat([best.new_zeros(1), torch.cumsum(best, 0)])
    num_valid = valid.sum().to(torch.int64)
    b = torch.arange(tau.numel(), device=tau.device)
    theta = torch.where(b <= num_valid, tau / seconds, float("-inf"))
    return DeviceCurves(torch.argmax(theta), _greedy_over_runs(theta, seconds, num_valid), num_valid, tau, theta)


def _greedy_over_runs(theta: Tensor, seconds: Tensor, num_valid: Tensor) -> Tensor:
    """`greedy_budget`'s scan on the device: the last budget of the first run of equal predicted seconds
    whose next run's theta does not exceed its own (runs past num_valid do not exist: theta -inf)."""
    b = torch.arange(theta.numel(), device=theta.device)
    differs = torch.cat([seconds[1:] != seconds[:-1], torch.ones(1, dtype=torch.bool, device=theta.device)])
    is_end = (b <= num_valid) & (differs | (b == num_valid))
    run = torch.cumsum(is_end.to(torch.int64), 0) - is_end.to(torch.int64)  # index of the run b belongs to
    run_theta = torch.full((theta.numel() + 1,), float("-inf"), dtype=theta.dtype, device=theta.device)
    run_theta = run_theta.scatter_reduce(0, run, torch.where(is_end, theta, float("-inf")), "amax")
    run_end = torch.full((theta.numel() + 1,), -1, dtype=torch.int64, device=theta.device)
    run_end = run_end.scatter_reduce(0, run, torch.where(is_end, b, -1), "amax")
    stops = run_theta[1:] <= run_theta[:-1]
    return run_end.index_select(0, torch.argmax(stops.to(torch.int8)).reshape(1)).squeeze(0)  # no host read


def seconds_over_window(cost_model: CostModel, num_requests: int, cfg: ScheduleConfig) -> Tensor:
    """float64 host [B * C + 1]: T(B, B * F + b) for every budget b a batch of B can take (C candidates
    per request); depends on B only, so a caller caches it on its device."""
    count = num_requests * (cfg.cap - cfg.floor) + 1
    return torch.from_numpy(cost_model.seconds_curve(num_requests, num_requests * cfg.floor, count))


def expected_commit_torch(survival: Tensor, verify_lens: Tensor) -> Tensor:
    """0-d float64 tau of an allocation on the device: sum_r (1 + sum_{j < verify_lens[r] - 1} s[r, j]) for
    monotone survival [B, gamma] and int verify_lens [B] (compiles with `fullgraph=True`)."""
    cols = torch.arange(survival.shape[1], device=survival.device)
    verified = cols.unsqueeze(0) < (verify_lens.to(survival.device, torch.int64) - 1).unsqueeze(1)
    return survival.shape[0] + torch.where(verified, survival, torch.zeros_like(survival)).to(torch.float64).sum()


def expected_commit(survival: Tensor, verify_lens: Tensor, cfg: ScheduleConfig) -> float:
    """tau of a given allocation: sum_r (1 + sum_{j < verify_lens[r] - 1} s[r, j]) (E[sum commit_lens])."""
    s, _ = candidate_window(survival, cfg)
    if not isinstance(verify_lens, Tensor):
        raise TypeError(f"verify_lens must be a tensor, got {type(verify_lens).__name__}")
    if verify_lens.dtype.is_floating_point or verify_lens.dtype == torch.bool:
        raise TypeError(f"verify_lens must be an integer tensor, got dtype {verify_lens.dtype}")
    if tuple(verify_lens.shape) != (s.shape[0],):
        raise ValueError(f"verify_lens must be [B={s.shape[0]}], got shape {tuple(verify_lens.shape)}")
    vl = verify_lens.to(s.device, torch.int64)
    check_verify_lens(vl, cfg.width)
    return float(expected_commit_torch(s, vl))
