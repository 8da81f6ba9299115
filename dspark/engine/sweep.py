"""Measure verify-step cost and judge cost models by the budgets they choose.

Sweep: which (B, rows) points to pin, and a timed, interleaved sweep of a `StepAdapter` (the built-in one
is `dspark.engine.verify_step.VerifyStepAdapter`: the engine's own verify step over a transformers model).

Rows are pinned at every tier top and at tier-2 .. tier+2 (where a smooth cost fit is most wrong), plus
the static point B*W; `dense_rows` gives every row count, for the measured oracle. Each repeat is one
pass over all points in a fresh random order (slow drift of a shared machine spreads over all points
instead of biasing some), and the sample is the median over passes. Device events time GPU/NPU steps;
CPU steps are timed by perf_counter or, on a shared machine, by the thread's CPU time.

Judge: `fit_cost_models` fits the 1-D, additive and tiered models side by side on one set of samples;
`budget_regret` replays survival matrices through each model's argmax (`choose_budget`) and through
a dense oracle, reporting the throughput lost and how often the model picked the wrong tier.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import torch
from torch import Tensor

from dspark.config import ScheduleConfig
from dspark.cost import (
    AdditiveCostModel,
    CostModel,
    ProfileSample,
    StepsPerSecondTable,
    TieredCostModel,
)
from dspark.plan.budget import choose_budget, tau_curve
from dspark.util.validate import check_int
from dspark.verify.layout import check_tiers, round_up_to_tier

EDGE_OFFSETS = (-2, -1, 0, 1, 2)


class StepAdapter(Protocol):
    """What the tier sweep needs from a verify step: set up a step of a given shape, then run it."""

    name: str
    device: torch.device

    def prepare(self, num_requests: int, rows: int) -> None:
        """Set up one step with `num_requests` requests verifying `rows` rows in total."""
        ...

    def step(self) -> None:
        """Run the prepared step once (asynchronously on a device; the sweep synchronizes)."""
        ...


def _row_range(num_requests: int, width: int, floor: int) -> tuple[int, int]:
    for name, v in (("num_requests", num_requests), ("width", width), ("floor", floor)):
        check_int(name, v, 1)
    if floor > width:
        raise ValueError(f"floor {floor} exceeds width W={width}")
    return num_requests * floor, num_requests * width


def tier_rows(tiers: Sequence[int], num_requests: int, width: int, floor: int = 1,
              offsets: Sequence[int] = EDGE_OFFSETS) -> list[int]:
    """Row counts in [B*F, B*W] at every tier + offset, plus both ends (B*W is the static step)."""
    lo, hi = _row_range(num_requests, width, floor)
    pts = {t + d for t in check_tiers(tiers) for d in offsets} | {lo, hi}
    return sorted(m for m in pts if lo <= m <= hi)


def tier_ladder(batch_sizes: Sequence[int], width: int) -> tuple[int, ...]:
    """Token tiers for steps of these batch sizes: 1..6 and 8, then alternately x1.5 and x4/3 (12, 16, 24,
    32, 48, ...) below the largest B*W, plus every B (a plain-sized step) and B*W (the static step), so every
    fixed-k step at full batch lands on a tier top unpadded and a step pads at most half its rows. Each lies in
    [B, B*W] of some B, so a profile at these batch sizes measures it (a drained batch with fewer requests
    pads up to the smallest tier)."""
    for b in batch_sizes:
        check_int("batch size", b, 1)
    check_int("width", width, 1)
    top = max(batch_sizes) * width
    ladder, t = [1, 2, 3, 4, 5, 6], 8
    while t < top:
        ladder.append(t)
        t = t * 3 // 2 if t & (t - 1) == 0 else t * 4 // 3
    edges = {b for b in batch_sizes} | {b * width for b in batch_sizes}
    reachable = [x for x in ladder if any(b <= x <= b * width for b in batch_sizes)]
    return tuple(sorted(set(reachable) | edges))


def dense_rows(num_requests: int, width: int, floor: int = 1) -> list[int]:
    """Every row count a step with B requests can have: [B*F, B*W]."""
    lo, hi = _row_range(num_requests, width, floor)
    return list(range(lo, hi + 1))


def split_rows(num_requests: int, rows: int, width: int) -> list[int]:
    """verify_lens with `rows` in total spread as evenly as possible over `num_requests` (each in [1, W])."""
    if num_requests < 1 or not num_requests <= rows <= num_requests * width:
        raise ValueError(f"rows={rows} must lie in [B, B*W] = [{num_requests}, {num_requests * width}]")
    q, r = divmod(rows, num_requests)
    return [q + 1] * r + [q] * (num_requests - r)


CLOCKS = ("wall", "thread")
STATS: dict[str, Callable[[list[float]], float]] = {"median": statistics.median, "min": min}


def step_timer(device: torch.device, clock: str = "wall") -> Callable[[Callable[[], None]], float]:
    """Seconds of one call: device events on cuda / npu; on the CPU `wall` (perf_counter) or `thread`
    (this thread's CPU time: not charged while preempted on a shared machine, exact with 1 intra-op thread)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    if device.type in ("cuda", "npu"):
        mod = getattr(torch, device.type)

        def timed(fn: Callable[[], None]) -> float:
            start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return timed
    now = time.perf_counter if clock == "wall" else time.thread_time

    def timed_cpu(fn: Callable[[], None]) -> float:
        t0 = now()
        fn()
        return now() - t0

    return timed_cpu


def profile_steps(adapter: StepAdapter, points: Sequence[tuple[int, int]], *, warmup: int = 1,
                  repeats: int = 5, inner: int = 1, seed: int = 0, clock: str = "wall", stat: str = "median",
                  progress: Callable[[int, int], None] | None = None) -> list[ProfileSample]:
    """Median seconds of `adapter.step()` at each (num_requests, rows) point, in the order given.

    warmup: untimed steps right before each timed one. inner: steps per timing (their mean is one
    repeat's value; averages out sub-step jitter). clock: see `step_timer` (CPU only). stat: `median`
    over repeats, or `min` (contention on a shared machine only ever slows a step down).
    progress(done, total) is called after each timed step.
    """
    if stat not in STATS:
        raise ValueError(f"stat must be one of {sorted(STATS)}, got {stat!r}")
    if warmup < 0 or repeats < 1 or inner < 1:
        raise ValueError(f"need warmup >= 0, repeats >= 1 and inner >= 1, got {warmup}, {repeats}, {inner}")
    pts = list(dict.fromkeys(points))
    timer = step_timer(adapter.device, clock)
    times: dict[tuple[int, int], list[float]] = {p: [] for p in pts}
    rng = random.Random(seed)
    total, done = len(pts) * repeats, 0

    def block() -> None:
        for _ in range(inner):
            adapter.step()

    for _ in range(repeats):
        order = pts[:]
        rng.shuffle(order)
        for b, m in order:
            adapter.prepare(b, m)
            for _ in range(warmup):
                adapter.step()
            times[(b, m)].append(timer(block) / inner)
            done += 1
            if progress is not None:
                progress(done, total)
    return [ProfileSample(num_requests=b, rows=m, seconds=STATS[stat](times[(b, m)])) for b, m in pts]


def fit_cost_models(samples: Sequence[ProfileSample], *, tiers: Sequence[int], width: int,
                    platform: str = "unknown", row_bin: int = 64) -> dict[str, CostModel]:
    """The cost models side by side, each fitted the way it is meant to be profiled, on one sample set.

    1-D: the static sweep's diagonal (rows = B*W), floor lookup. additive: every sample inside the
    tiers, M binned to `row_bin`. tiered: every sample inside the tiers, keyed on the replayed tier;
    tiered-dense: the same with the measured (B, tier) cell medians as a lookup table.
    """
    tiers = check_tiers(tiers)
    inside = [s for s in samples if s.rows <= tiers[-1]]
    static = [s for s in samples if s.rows == s.num_requests * width]
    if not static:
        raise ValueError(f"the 1-D table needs static samples (rows = B*W = B*{width}); none were given")
    common = {"platform": platform, "width": width}
    return {
        "1-D": StepsPerSecondTable.fit(static, **common)[0],
        "additive": AdditiveCostModel.fit(inside, row_bin=row_bin, **common)[0],
        "tiered": TieredCostModel.fit(inside, tiers=tiers, **common)[0],
        "tiered-dense": TieredCostModel.fit(inside, tiers=tiers, dense=True, **common)[0],
    }


@dataclass(frozen=True)
class Regret:
    """Throughput lost by planning with a model instead of the oracle, over many survival matrices."""

    mean: float              # mean of 1 - theta_true(b_model) / theta_true(b_oracle)
    p90: float
    max: float
    wrong_tier_rate: float   # fraction of decisions whose replayed tier differs from the oracle's
    num_decisions: int


def budget_regret(survivals: Sequence[Tensor], models: Mapping[str, CostModel],
                  oracle: Callable[[int, Tensor], Tensor], *, cfg: ScheduleConfig,
                  tiers: Sequence[int]) -> dict[str, Regret]:
    """Each model's budget (`choose_budget`) judged by the oracle's seconds `oracle(B, rows) -> [n]`.

    The oracle's own best budget is the argmax of tau(b) / oracle(B, B*F + b), ties to the smaller b.
    """
    tiers = check_tiers(tiers)
    losses: dict[str, list[float]] = {n: [] for n in models}
    wrong: dict[str, int] = {n: 0 for n in models}
    for s in survivals:
        b = s.shape[0]
        tau = tau_curve(s, cfg)
        rows = b * cfg.floor + torch.arange(tau.numel(), dtype=torch.int64)
        theta = tau / oracle(b, rows).to(torch.float64)
        best = int(torch.argmax(theta))
        best_tier = round_up_to_tier(int(rows[best]), tiers)
        for name, model in models.items():
            pick = choose_budget(s, cost_model=model, cfg=cfg).budget
            losses[name].append(1.0 - float(theta[pick] / theta[best]))
            wrong[name] += round_up_to_tier(int(rows[pick]), tiers) != best_tier
    if not survivals:
        raise ValueError("budget_regret needs at least one survival matrix")
    out = {}
    for name, vals in losses.items():
        v = torch.tensor(vals, dtype=torch.float64)
        out[name] = Regret(float(v.mean()), float(torch.quantile(v, 0.9)), float(v.max()),
                           wrong[name] / len(vals), len(vals))
    return out
