"""Profile this machine's whole decode-step cost T(B, M) and fit a cost model for the planner.

A step's cost is what the planner trades against expected progress: drafting gamma tokens (depends on
B), the verify forward over M rows, and the accept. Each sample runs the real decode loop with a
profiling policy that forces exactly M verify rows, and takes the median step time. The plain
(target-only) step T_plain(B) is profiled the same way: the adaptive policy compares the two to decide
whether to speculate at all.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from dspark.config import VerifyMode
from dspark.cost import (
    AdditiveCostModel,
    CostModel,
    FitReport,
    ProfileSample,
    StepsPerSecondTable,
    TieredCostModel,
    serving_tiers,
)
from dspark.lab.sweep import tier_rows
from dspark.lab.timing import lockstep
from dspark.serve.engine import SpecDecoder
from dspark.serve.outcome import GenerateResult
from dspark.serve.policies import FixedK, Policy, PolicyPlan
from dspark.util.validate import check_int, check_type
from dspark.verify.accept import AcceptResult
from dspark.verify.layout import round_up_to_tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileRuns:
    """How each profiled point runs: runs of `tokens` new tokens per request, the median over `repeats` of them
    (lockstep sweeps for the whole-step profile)."""

    tokens: int = 12
    repeats: int = 2

    def __post_init__(self) -> None:
        check_int("tokens", self.tokens, 1)
        check_int("repeats", self.repeats, 1)


class ForcedRows(Policy):
    """Profiling policy: draft gamma tokens, verify `rows` rows for `batch` requests spread evenly (the same
    rows per request once finished requests have left the batch)."""

    name = "forced-rows"

    def __init__(self, gamma: int, rows: int, batch: int):
        self.num_drafts, self.rows, self.batch = gamma, rows, batch

    def plan(self, confidence_logits: Tensor, slots: Tensor, generations: Tensor,
             prepass: Callable[[], AcceptResult] | None = None) -> PolicyPlan:
        b = confidence_logits.shape[0]
        extra = (self.rows - self.batch) * b // self.batch
        lens = 1 + extra // b + (torch.arange(b) < extra % b).to(torch.int32)
        return PolicyPlan(lens.to(torch.int32).to(confidence_logits.device))


def row_grid(batch: int, width: int, points: int) -> list[int]:
    """`points` row totals from B (roots only) to B * W, evenly spaced, distinct."""
    top = batch * width
    return sorted({batch + round(i * (top - batch) / (points - 1)) for i in range(points)})


def profile_points(batch_sizes: Sequence[int], gamma: int, tiers: Sequence[int] = (), points: int = 5
                   ) -> list[tuple[int, int]]:
    """(B, M) points: `points` evenly spaced M per B, or with tiers every tier top inside [B, B*W] (a step
    pads its rows to a tier top, so a tier's cost is its top's) plus B and B*W where they fit the largest
    tier."""
    if not tiers:
        return [(b, m) for b in batch_sizes for m in row_grid(b, gamma + 1, points)]
    return [(b, m) for b in batch_sizes for m in tier_rows(tiers, b, gamma + 1, offsets=(0,)) if m <= tiers[-1]]


def _median_step(res: GenerateResult) -> float:
    """Median seconds of one run's steps that still had every request in the batch."""
    secs = torch.tensor([s.times.draft + s.times.plan + s.times.verify + s.times.accept
                         for s in res.steps if s.requests.numel() == res.max_batch], dtype=torch.float64)
    return float(secs.median())


@dataclass(frozen=True)
class PlainStepCost:
    """T_plain(B): seconds of one target-only step, profiled at a few batch sizes.

    Between profiled sizes the time is interpolated linearly in B; below the smallest it is the smallest's
    time (small steps are overhead-bound), above the largest it grows in proportion to B.
    """

    batch_sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.batch_sizes or len(self.batch_sizes) != len(self.seconds):
            raise ValueError(f"need one time per batch size, got {self.batch_sizes} / {self.seconds}")
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or self.batch_sizes[0] < 1:
            raise ValueError(f"batch sizes must be distinct, increasing and >= 1, got {self.batch_sizes}")
        if not all(s > 0 for s in self.seconds):
            raise ValueError(f"plain step times must be positive, got {self.seconds}")

    def step_seconds(self, num_requests: int) -> float:
        """Seconds of a plain step over `num_requests` requests."""
        bs, ts = self.batch_sizes, self.seconds
        if num_requests <= bs[0]:
            return ts[0]
        if num_requests >= bs[-1]:
            return ts[-1] * num_requests / bs[-1]
        i = next(i for i, b in enumerate(bs) if b >= num_requests)
        f = (num_requests - bs[i - 1]) / (bs[i] - bs[i - 1])
        return ts[i - 1] + f * (ts[i] - ts[i - 1])

    def to_dict(self) -> dict:
        return {"batch_sizes": list(self.batch_sizes), "seconds": list(self.seconds)}


def profile_step_costs(decoder: SpecDecoder, prompts: Tensor, grid: Sequence[tuple[int, int]], gamma: int, *,
                       runs: ProfileRuns = ProfileRuns(), mode: VerifyMode = VerifyMode.COMPACT,
                       progress: Callable[[], None] | None = None
                       ) -> tuple[list[ProfileSample], PlainStepCost]:
    """Whole-step seconds of a speculative step at each (B, M) point and of a plain step at each B.

    Each value is the median over `runs.repeats` sweeps of each run's median step (runs of `runs.tokens` new
    tokens) with all B requests still in the batch (one warm-up run per B first). A sweep runs, per B, the plain
    run and every M's run in `lockstep` (interleaved step by step on forked decoders), so bursts of machine load
    hit all points (and both sides of the speculate-or-not comparison) alike instead of biasing one. Give the
    decoder the timed runs' max_new_tokens as its `EngineConfig.reserve_new_tokens`, so the profiled steps see the
    KV geometry (pages per request) of the steps they predict.
    """
    check_type("runs", runs, ProfileRuns)
    tokens, repeats = runs.tokens, runs.repeats
    batch_sizes = sorted({b for b, _ in grid})
    for b in batch_sizes:
        decoder.generate(prompts[:b], 2, ForcedRows(gamma, b * (gamma + 1), b), mode=mode)
    width = max(sum(1 for bb, _ in grid if bb == b) for b in batch_sizes) + 1
    forks = [decoder.fork() for _ in range(width)]  # one decoder per run of a B's lockstep sweep
    runs: dict[tuple[int, int], list[float]] = {key: [] for key in grid}
    plain: dict[int, list[float]] = {b: [] for b in batch_sizes}
    for _ in range(repeats):
        for b in batch_sizes:
            rows = [m for bb, m in grid if bb == b]
            started = {"plain": forks[0].start(prompts[:b], tokens, FixedK(0), mode=VerifyMode.STATIC)}
            started.update({m: f.start(prompts[:b], tokens, ForcedRows(gamma, m, b), mode=mode)
                            for f, m in zip(forks[1:], rows)})
            results = lockstep(started)
            plain[b].append(_median_step(results["plain"]))
            for m in rows:
                runs[(b, m)].append(_median_step(results[m]))
                if progress:
                    progress()
    samples = [ProfileSample(num_requests=b, rows=m, seconds=float(torch.tensor(runs[(b, m)]).median()))
               for b, m in grid]
    return samples, PlainStepCost(tuple(batch_sizes), tuple(float(torch.tensor(plain[b]).median())
                                                            for b in batch_sizes))


def monotone_in_rows(samples: Sequence[ProfileSample]) -> list[ProfileSample]:
    """Per batch size, the least-squares fit of the step times that never decreases with the rows
    (pool-adjacent-violators): a step with more verify rows cannot cost less, so a dip between two profiled
    row counts is timing noise, and a cost model fitted through it would make the budget scan stop at it."""
    out: list[ProfileSample] = []
    for b in sorted({s.num_requests for s in samples}):
        row = sorted((s for s in samples if s.num_requests == b), key=lambda s: s.rows)
        blocks: list[list[float]] = []  # [sum, count] of pooled neighbours
        for s in row:
            blocks.append([s.seconds, 1.0])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                total, count = blocks.pop()
                blocks[-1][0] += total
                blocks[-1][1] += count
        values = [total / count for total, count in blocks for _ in range(int(count))]
        out += [ProfileSample(num_requests=b, rows=s.rows, seconds=v) for s, v in zip(row, values)]
    return out


def fit_cost_model(samples: Sequence[ProfileSample], gamma: int, platform: str, tiers: Sequence[int] = (),
                   row_bins: Sequence[int] = (1, 8, 32, 64)) -> tuple[CostModel, FitReport, int | None]:
    """With tiers: TieredCostModel over the `serving_tiers` (a tier that ran slower than a larger one is
    left out, and its samples with it: steps pad past it) with the measured (B, tier) cells as its table
    (a CPU's matmul cost is not additive in B and the rows: it jumps and dips with the row count); the
    model's `tiers` are the ones to serve with. Without: the additive model
    `bias + alpha(B) + theta(M)` with theta non-decreasing and convex in M (`convex_rows`: the lag-0
    greedy budget scan then finds the argmax; an unconstrained per-row theta threads every noisy sample,
    and its dips stop the scan early) at the finest M binning whose fit is valid (a fit that predicts a
    non-positive time somewhere is refused; coarser bins average the noise out); when no binning gives a valid fit (very noisy timings), the 1-D steps/s table fitted
    on the same samples, with a logged warning. The samples are first made non-decreasing in the rows per
    batch size (`monotone_in_rows`). Returns (model, report, row_bin used or None)."""
    if tiers:
        served = serving_tiers(samples, tiers)
        kept = [s for s in samples if round_up_to_tier(s.rows, tiers) in served]
        model, report = TieredCostModel.fit(monotone_in_rows(kept), tiers=served, dense=True, platform=platform,
                                            width=gamma + 1)
        return model, report, None
    samples = monotone_in_rows(samples)
    errors = []
    for row_bin in row_bins:
        try:
            model, report = AdditiveCostModel.fit(samples, row_bin=row_bin, platform=platform, width=gamma + 1,
                                                  convex_rows=True)
            return model, report, row_bin
        except ValueError as e:
            errors.append(f"row_bin={row_bin}: {e}")
    log.warning("no valid additive cost model fit (%s); falling back to the 1-D steps/s table",
                "; ".join(errors))
    model, report = StepsPerSecondTable.fit(samples, platform=platform, width=gamma + 1)
    return model, report, None
