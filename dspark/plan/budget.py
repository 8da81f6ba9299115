"""The global verify budget: tau(b), T(B, M(b)) and theta(b) = tau(b) / T over every budget b at once.

With floor F and cap M_max (DESIGN.md 4.2) every request verifies its root and drafts 0..F-2; the
candidates are draft columns j in [F-1, M_max-2] with survival >= survival_eps, ranked globally by
survival (DESIGN.md 4.3). Then

    tau(b)  = sum_r (1 + sum_{j < F-1} s[r, j]) + (sum of the b best candidates)
    rows(b) = B * F + b,   theta(b) = tau(b) / T(B, rows(b)),   b in [0, #candidates].

`choose_budget` takes the argmax of theta (ties to the smaller b). Callers hand it survival at least
one step old (lagged) so that admitting a draft never depends on that draft's own value
(non-anticipation, DESIGN.md 4.4); `greedy_budget` is the synchronous alternative.

Two backends, one formula, one result: the host decision (`host_decision`: numpy sort, torch's sequential
cumsum) for eager calls, whatever the survival's device, and the traced one (`traced_decision` over
`dspark.plan.budget_torch`'s formulas) inside `torch.compile` and for the planner's device steps. Both give a
`BudgetDecision` of the same dtypes and static shapes (curves over every budget b = 0..B * C). The public
functions check their inputs, then call these; the planner, validated once, calls them directly.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from dspark.config import ScheduleConfig
from dspark.cost import CostModel, check_cost_model
from dspark.kernels import dispatch
from dspark.plan.budget_torch import _tau_torch, expected_commit_torch, theta_curves_torch
from dspark.plan.survival import _check_matrix, monotone_host, monotone_survival
from dspark.util.validate import check_verify_lens
from dspark.verify import boundary
from dspark.verify.layout import check_tiers

HOST_PLAN_MAX = 16384  # survival entries (B * gamma) up to which a planner plans an accelerator's step on the host


def check_config(cfg: object) -> ScheduleConfig:
    """`cfg` when it is a ScheduleConfig; TypeError naming it otherwise."""
    if not isinstance(cfg, ScheduleConfig):
        raise TypeError(f"cfg must be a ScheduleConfig, got {type(cfg).__name__}: {cfg!r}")
    return cfg


class HostSurvival:
    """One step's survival on the host: float32 numpy [B, gamma], non-increasing along positions, NaN-free.

    The budget scan and the allocation both take it in place of the tensor, so a step planned on the host
    pays one device-to-host copy and one sort of its candidate window (`window`, kept for the config last
    asked): small numpy arrays cost far less per call than a chain of torch ops.
    """

    __slots__ = ("values", "_cfg", "_ranked", "_num_valid")

    def __init__(self, values: np.ndarray):
        self.values = values
        self._cfg: ScheduleConfig | None = None

    def window(self, cfg: ScheduleConfig) -> tuple[np.ndarray, int]:
        """(the candidate window `values[:, F-1 : M_max-1]` sorted ascending, float32 [B * C]; #candidates,
        the values >= survival_eps compared in float32, which are the largest ones)."""
        if self._cfg is not cfg:
            self._ranked = np.sort(self.values[:, cfg.floor - 1: cfg.cap - 1], axis=None)
            self._num_valid = self._ranked.size - int(self._ranked.searchsorted(np.float32(cfg.survival_eps)))
            self._cfg = cfg
        return self._ranked, self._num_valid


def _check_survival(survival: Tensor | HostSurvival, cfg: ScheduleConfig) -> None:
    shape = survival.values.shape if isinstance(survival, HostSurvival) else _check_matrix("survival", survival).shape
    if len(shape) != 2 or shape[1] != cfg.gamma:
        raise ValueError(f"survival must be [B, gamma={cfg.gamma}], got shape {tuple(shape)}")


def host_survival(survival: Tensor, calibrated: bool = False) -> HostSurvival:
    """The survival on the host (a view of a float32 CPU tensor, else one `boundary.to_host` copy),
    repaired as `monotone_survival` unless `calibrated` or already non-increasing and NaN-free."""
    if survival.is_cpu and survival.dtype == torch.float32 and not survival.requires_grad:
        values = survival.numpy()  # a view: no copy, no device read
    else:
        values = boundary.to_host(survival.to(torch.float32))
    return HostSurvival(values if calibrated else monotone_host(values))


@dataclass(frozen=True)
class BudgetDecision:
    """The chosen budget and its curves over every budget b = 0..B * C a batch of B can take (C candidate
    columns, `cfg.num_candidate_columns`): tensors of the same dtypes, shapes and values in eager and
    `torch.compile` calls; on the host where the decision was made there (eager calls, whatever the survival's
    device: no copy back), on the survival's device when traced. Past #candidates, tau repeats tau(#candidates)
    and theta is -inf.
    """

    budget: Tensor               # 0-d int64: the chosen b
    base_rows: int               # B * F: verify rows at b = 0
    tau_curve: Tensor            # float64 [B * C + 1]: expected committed tokens tau(b)
    step_seconds_curve: Tensor   # float64 [B * C + 1]: T(B, B * F + b)
    theta_curve: Tensor          # float64 [B * C + 1]: tau(b) / T, -inf past #candidates

    @property
    def rows(self) -> Tensor:
        """0-d int64: the verify rows B * F + budget."""
        return self.budget + self.base_rows

    @property
    def tau(self) -> Tensor:
        """0-d float64: tau at the chosen budget."""
        return _at(self.tau_curve, self.budget)

    @property
    def step_seconds(self) -> Tensor:
        """0-d float64: T(B, rows) at the chosen budget."""
        return _at(self.step_seconds_curve, self.budget)

    @property
    def theta(self) -> Tensor:
        """0-d float64: theta at the chosen budget."""
        return _at(self.theta_curve, self.budget)

    @property
    def num_candidates(self) -> Tensor:
        """0-d int64: the candidates (survival >= survival_eps); the curves' budgets past it add nothing."""
        return (self.theta_curve > float("-inf")).sum() - 1

    @property
    def rows_curve(self) -> Tensor:
        """int64 [B * C + 1]: verify rows B * F + b for each budget b of the curves."""
        return self.base_rows + torch.arange(self.tau_curve.numel(), dtype=torch.int64, device=self.tau_curve.device)


def _at(curve: Tensor, budget: Tensor) -> Tensor:
    return curve.index_select(0, budget.reshape(1)).squeeze(0)  # a tensor index: no host read


class HostCurves(NamedTuple):
    """Host float64 curves over b = 0..B * C; budgets past `num_valid` as `BudgetDecision`'s."""
    base: int  # B * F: rows at b = 0
    num_valid: int  # #candidates
    tau: np.ndarray
    seconds: np.ndarray | None
    theta: np.ndarray | None


def _host_curves(host: HostSurvival, cost_model: CostModel | None, cfg: ScheduleConfig,
                 seconds: np.ndarray | None) -> HostCurves:
    """tau from the sorted window (sequential float64 prefix sums, best first), and with a cost model
    T(B, B * F + b) (`seconds`, when the caller cached the whole window, else `seconds_curve`) and theta."""
    values, f = host.values, cfg.floor
    (asc, n), b = host.window(cfg), values.shape[0]  # the valid: the n largest
    floor = b + (values[:, : f - 1].sum(dtype=np.float64) if f > 1 else 0.0)
    tau = np.empty(asc.size + 1)
    tau[0] = 0.0
    np.cumsum(asc[asc.size - n:][::-1], dtype=np.float64, out=tau[1: n + 1])  # sequential, like torch's on a CPU
    tau[n + 1:] = tau[n]
    tau += floor
    if cost_model is None:
        return HostCurves(b * f, n, tau, None, None)
    seconds = cost_model.seconds_curve(b, b * f, tau.size) if seconds is None else seconds[: tau.size]
    theta = tau / seconds
    theta[n + 1:] = -np.inf
    return HostCurves(b * f, n, tau, seconds, theta)


def tier_keys(rows: np.ndarray, tiers: Sequence[int]) -> np.ndarray:
    """Per row count, the tier it replays (the smallest tier >= rows), or past the largest tier a key of
    its own: equal keys are one run of `greedy_budget`'s scan."""
    t = np.asarray(tiers, dtype=np.int64)
    return np.where(rows > t[-1], rows + t.size, np.searchsorted(t, rows, side="left"))


@functools.lru_cache(maxsize=1024)
def _tier_run_ends(base: int, count: int, tiers: tuple[int, ...]) -> np.ndarray:
    """The last budget of each tier's run over budgets 0..count-1 (rows base + b), the window's last excepted."""
    key = tier_keys(base + np.arange(count), tiers)
    ends = np.flatnonzero(key[1:] != key[:-1])
    ends.setflags(write=False)  # shared by every call with these arguments
    return ends


def _scan_ends(base: int, seconds: np.ndarray, last: int, tiers: Sequence[int] | None) -> np.ndarray:
    """The greedy scan's units over budgets 0..last: the last budget of each run of one tier (`tiers`, rows
    base + b) or of equal predicted seconds (`seconds` [>= last + 1]), `last` included."""
    if tiers:  # the runs depend on B and the tiers only: found once per window
        ends = _tier_run_ends(base, seconds.size, tuple(tiers))
        ends = ends[: ends.searchsorted(last)]
    else:
        ends = np.flatnonzero(seconds[1: last + 1] != seconds[:last])
    return np.append(ends, last)


def _greedy_stop(c: HostCurves, tiers: Sequence[int] | None) -> int:
    """`greedy_budget`'s scan over runs of one tier, or of equal predicted seconds (see its docstring)."""
    ends = _scan_ends(c.base, c.seconds, c.num_valid, tiers)
    stops = np.flatnonzero(c.theta[ends[1:]] <= c.theta[ends[:-1]])
    return int(ends[stops[0]] if stops.size else ends[-1])


def host_choice(host: HostSurvival, cost_model: CostModel, cfg: ScheduleConfig, *, greedy: bool = False,
                seconds: np.ndarray | None = None, tiers: Sequence[int] | None = None) -> tuple[int, HostCurves]:
    """`choose_budget` (or with `greedy`, `greedy_budget`) on the host, without checks; its `BudgetDecision` not
    yet made (`curves_decision`: a planner makes it when a caller first reads the plan's decision).

    Args:
        host: the step's survival on the host; cost_model: a model that fits the config (`check_cost_model`).
        cfg: the schedule; greedy: the synchronous early-stop scan instead of the argmax.
        seconds: float64 [>= #candidates + 1] T(B, B * F + b) when the caller caches it per B
            (`seconds_over_window`); None reads `cost_model.seconds_curve`.
        tiers: the graph tiers the step pads to (checked, ascending): the greedy scan's runs.
    Returns:
        (the budget as an int, its host curves).
    """
    c = _host_curves(host, cost_model, cfg, seconds)
    return (_greedy_stop(c, tiers) if greedy else int(c.theta.argmax())), c


def curves_decision(budget: int, c: HostCurves) -> BudgetDecision:
    """The `BudgetDecision` of a host choice: its budget and curves as host tensors (views of the curves)."""
    chosen = torch.from_numpy(np.array(budget, dtype=np.int64))  # 0-d (cheaper than torch.tensor(budget))
    return BudgetDecision(chosen, c.base, torch.from_numpy(c.tau), torch.from_numpy(c.seconds),
                          torch.from_numpy(c.theta))


def host_decision(host: HostSurvival, cost_model: CostModel, cfg: ScheduleConfig, *, greedy: bool = False,
                  seconds: np.ndarray | None = None, tiers: Sequence[int] | None = None) -> tuple[int, BudgetDecision]:
    """`host_choice` with its decision made: (the budget as an int, the BudgetDecision on the host)."""
    k, curves = host_choice(host, cost_model, cfg, greedy=greedy, seconds=seconds, tiers=tiers)
    return k, curves_decision(k, curves)


def full_window_bound(seconds: np.ndarray, num_requests: int, cfg: ScheduleConfig, *, greedy: bool,
                      tiers: Sequence[int] | None = None) -> float:
    """A survival above which `host_decision` takes every candidate: when each candidate of a step's window is at
    least this, the argmax (or with `greedy` the early-stop scan over `tiers`' runs) is the whole window, with a
    margin far above float64 rounding (survivals <= 1; docs/architecture.md); inf without candidates.

    Args:
        seconds: float64 [B * C + 1] T(B, B * F + b) (`seconds_over_window`); num_requests: B.
        cfg: the schedule; greedy / tiers: as `host_decision`.
    Returns:
        The bound, >= cfg.survival_eps.
    """
    n, base = seconds.size - 1, num_requests * cfg.floor
    if n <= 0 or not (seconds.min() > 0 and np.isfinite(seconds).all()):  # no window, or one past the tiers
        return float("inf")
    if greedy:  # the scan's units when every candidate is valid
        ends = _scan_ends(base, seconds, n, tiers)
        lo, hi = ends[:-1], ends[1:]
    else:
        lo, hi = np.arange(n), np.full(n, n)
    # theta(hi) > theta(lo) once (hi - lo) * s_min * T(lo) > (B * F + lo) * (T(hi) - T(lo)), tau(lo) <= B * F + lo
    need = (base + lo) * np.maximum(seconds[hi] - seconds[lo], 0.0) / ((hi - lo) * seconds[lo])
    margin = 1e-7 * num_requests * cfg.width * float(seconds.max() / seconds.min())
    return max(cfg.survival_eps, float(need.max(initial=0.0)) * (1 + 1e-6) + margin)


def traced_decision(survival: Tensor, seconds: Tensor, cfg: ScheduleConfig, *, greedy: bool = False,
                    tiers: Tensor | None = None) -> BudgetDecision:
    """The budget with torch ops only (static shapes, no host read): the `torch.compile` path.

    Args:
        survival: [B, gamma] non-increasing, NaN-free (`monotone_survival` / calibrated).
        seconds: float64 [B * C + 1] T(B, B * F + b) on the survival's device.
        cfg: the schedule; greedy: the early-stop scan instead of the argmax.
        tiers: int64 [T] ascending graph tiers on the survival's device (the greedy scan's runs), or None.
    Returns:
        The BudgetDecision on the survival's device.
    """
    curves = theta_curves_torch(survival, seconds, cfg.floor, cfg.cap, cfg.survival_eps, tiers)
    k = curves.greedy if greedy else curves.budget
    return BudgetDecision(k, survival.shape[0] * cfg.floor, curves.tau, seconds, curves.theta)


def seconds_torch(cost_model: CostModel, num_requests: int, cfg: ScheduleConfig, device: torch.device) -> Tensor:
    """float64 [B * C + 1] T(B, B * F + b) from `cost_model.step_seconds` on `device` (traceable for models
    whose `step_seconds` is)."""
    count = num_requests * cfg.num_candidate_columns + 1
    rows = num_requests * cfg.floor + torch.arange(count, dtype=torch.float64, device=device)
    return cost_model.step_seconds(num_requests, rows)


def seconds_over_window(cost_model: CostModel, num_requests: int, cfg: ScheduleConfig) -> Tensor:
    """float64 host [B * C + 1]: T(B, B * F + b) for every budget b a batch of B can take (C candidates
    per request); depends on B only, so a caller caches it (on its device)."""
    count = num_requests * cfg.num_candidate_columns + 1
    return torch.from_numpy(cost_model.seconds_curve(num_requests, num_requests * cfg.floor, count))


def filled_tier_seconds(window: np.ndarray) -> np.ndarray:
    """Step seconds [n] per budget with each tier's padding shared out: within a run of equal prices (a tier:
    its free rows are filled by the planner's allocation), linear from the previous run's last price to this
    run's, never above the tier's own price (a cheaper tier after a dearer one keeps its price); an untiered
    window is returned as it is.

    window: float64 [n], T(B, B * F + budget) per budget (`seconds_over_window`).
    """
    n = window.shape[0]
    idx = np.arange(n)
    differs = window[1:] != window[:-1]
    change, ends = np.r_[False, differs], np.r_[differs, True]  # a new price starts / a price run ends here
    prev = np.maximum.accumulate(np.where(change, idx - 1, -1))  # the previous run's last budget (-1: none)
    end = np.minimum.accumulate(np.where(ends, idx, n)[::-1])[::-1]  # this run's last budget
    out = window.copy()
    has = prev >= 0
    p, e, i = prev[has], end[has], idx[has]
    out[has] = window[p] + (i - p) / (e - p) * (window[i] - window[p])
    out[ends] = window[ends]  # a tier's last budget pays the tier, exactly
    return np.minimum(out, window)


def _decide(survival: Tensor | HostSurvival, cost_model: CostModel, cfg: ScheduleConfig,
            greedy: bool, tiers: Sequence[int] | None = None) -> BudgetDecision:
    cfg = check_config(cfg)
    check_cost_model(cost_model, width=cfg.width)
    _check_survival(survival, cfg)
    tiers = check_tiers(tiers) or None
    if isinstance(survival, HostSurvival):
        return host_decision(survival, cost_model, cfg, greedy=greedy, tiers=tiers)[1]
    if dispatch.tracing():
        s = monotone_survival(survival)
        t = None if tiers is None else torch.tensor(tiers, dtype=torch.int64, device=s.device)
        return traced_decision(s, seconds_torch(cost_model, s.shape[0], cfg, s.device), cfg, greedy=greedy, tiers=t)
    return host_decision(host_survival(survival), cost_model, cfg, greedy=greedy, tiers=tiers)[1]


def choose_budget(survival: Tensor | HostSurvival, cost_model: CostModel, cfg: ScheduleConfig) -> BudgetDecision:
    """argmax_b theta(b) over b in [0, #candidates], ties to the smaller b (hand in lagged survival).

    Args:
        survival: floating [B, gamma] (made non-increasing first, NaN -> 0), or the step's `HostSurvival`.
        cost_model: profiled at the config's W (`check_cost_model`).
        cfg: the schedule.
    Returns:
        The BudgetDecision: on the host in eager calls, on the survival's device inside `torch.compile`.
    """
    return _decide(survival, cost_model, cfg, greedy=False)


def greedy_budget(survival: Tensor | HostSurvival, cost_model: CostModel, cfg: ScheduleConfig,
                  tiers: Sequence[int] | None = None) -> BudgetDecision:
    """Synchronous (lag = 0) budget: admit candidates best-first while theta strictly rises.

    The scan's unit is a run of candidates admitted together: with `tiers` (the graph tiers the step pads
    to) the candidates whose rows replay the same tier, else those the cost model prices the same as the
    rows before them (one tier of a `TieredCostModel`, one bucket of a steps/s table). A run's time is paid
    with its first row, and graph-tier fill adds the rest anyway; a row-by-row scan would stop at every
    tier edge. So this equals the sequential scan over the runs' last budgets that stops at the first run
    whose theta does not exceed the previous run's (evaluated vectorized); with a strictly increasing
    cost every run is one candidate. Caveat: the stop test reads the next run's own survivals, so this is
    non-anticipating only to the extent the survival of a draft is fixed before its token is known;
    it may also stop at a local maximum below the free argmax. Use lag >= 1 for the strict guarantee.

    Args and returns as `choose_budget`; tiers: ascending ints, or None.
    """
    return _decide(survival, cost_model, cfg, greedy=True, tiers=tiers)


def tau_curve(survival: Tensor, cfg: ScheduleConfig) -> Tensor:
    """tau(b) for every budget.

    Args:
        survival: floating [B, gamma] (made non-increasing first, NaN -> 0).
        cfg: the schedule.
    Returns:
        float64 [B * C + 1] on the survival's device (C = `cfg.num_candidate_columns`), eager and compiled
        alike: tau(b) for b = 0 .. B * C, repeating tau(#candidates) past the last candidate above
        `survival_eps`.
    """
    cfg = check_config(cfg)
    _check_survival(survival, cfg)
    return _tau_torch(monotone_survival(survival), cfg.floor, cfg.cap, cfg.survival_eps)[0]


def expected_commit(survival: Tensor, verify_lens: Tensor, cfg: ScheduleConfig) -> Tensor:
    """tau of a given allocation: sum_r (1 + sum_{j < verify_lens[r] - 1} s[r, j]) (E[sum commit_lens]).

    Args:
        survival: floating [B, gamma] (made non-increasing first, NaN -> 0).
        verify_lens: integer [B] in [1, W].
        cfg: the schedule.
    Returns:
        0-d float64 tensor on the survival's device, eager and compiled alike.
    """
    cfg = check_config(cfg)
    _check_survival(survival, cfg)
    if not isinstance(verify_lens, Tensor):
        raise TypeError(f"verify_lens must be a tensor, got {type(verify_lens).__name__}")
    if verify_lens.dtype.is_floating_point or verify_lens.dtype == torch.bool:
        raise TypeError(f"verify_lens must be an integer tensor, got dtype {verify_lens.dtype}")
    if tuple(verify_lens.shape) != (survival.shape[0],):
        raise ValueError(f"verify_lens must be [B={survival.shape[0]}], got shape {tuple(verify_lens.shape)}")
    s = monotone_survival(survival)
    if dispatch.tracing():  # the range check reads the lengths: skipped in a traced step
        return expected_commit_torch(s, verify_lens)
    vl = verify_lens.to(s.device, torch.int64)
    check_verify_lens(vl, cfg.width)
    return expected_commit_torch(s, vl)
