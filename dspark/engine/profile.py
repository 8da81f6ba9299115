"""Profile this machine's whole decode-step cost T(B, M) and fit a cost model for the planner.

A step's cost is what the planner trades against expected progress: drafting gamma tokens (depends on
B), the verify forward over M rows, and the accept. Each sample runs the real decode loop with a
profiling policy that forces exactly M verify rows, and takes the median step time.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from dspark.config import VerifyMode
from dspark.cost import AdditiveCostModel, CostModel, FitReport, ProfileSample, TieredCostModel
from dspark.engine.decode import SpecDecoder
from dspark.engine.policies import PolicyPlan
from dspark.profiling import tier_rows


class ForcedRows:
    """Profiling policy: draft gamma tokens, verify `rows` rows for `batch` requests spread evenly (the same
    rows per request once finished requests have left the batch)."""

    prepass = False
    name = "forced-rows"

    def __init__(self, gamma: int, rows: int, batch: int):
        self.num_drafts, self.rows, self.batch = gamma, rows, batch

    def plan(self, confidence_logits: Tensor, slots: Tensor, generations: Tensor) -> PolicyPlan:
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
    """(B, M) points: `points` evenly spaced M per B, or with tiers the tier sweep's rows (every tier
    top and tier-2 .. tier+2 inside [B, B*W]) that fit the largest tier."""
    if not tiers:
        return [(b, m) for b in batch_sizes for m in row_grid(b, gamma + 1, points)]
    return [(b, m) for b in batch_sizes for m in tier_rows(tiers, b, gamma + 1) if m <= tiers[-1]]


def profile_step_costs(decoder: SpecDecoder, prompts: Tensor, grid: Sequence[tuple[int, int]], gamma: int, *,
                       tokens: int = 12, repeats: int = 2, mode: VerifyMode = VerifyMode.COMPACT,
                       progress: Callable[[], None] | None = None) -> list[ProfileSample]:
    """Whole-step seconds at each (B, M) point: median over `repeats` interleaved sweeps of each run's
    median step with all B requests still in the batch (one warm-up run per B first; sweeps interleave so bursts of machine load spread over
    all points instead of biasing one)."""
    batch_sizes = sorted({b for b, _ in grid})
    for b in batch_sizes:
        decoder.generate(prompts[:b], 2, ForcedRows(gamma, b * (gamma + 1), b), mode=mode)
    runs: dict[tuple[int, int], list[float]] = {key: [] for key in grid}
    for _ in range(repeats):
        for b, m in grid:
            res = decoder.generate(prompts[:b], tokens, ForcedRows(gamma, m, b), mode=mode)
            secs = torch.tensor([s.times.draft + s.times.plan + s.times.verify + s.times.accept
                                 for s in res.steps if s.requests.numel() == b], dtype=torch.float64)
            runs[(b, m)].append(float(secs.median()))
            if progress:
                progress()
    return [ProfileSample(num_requests=b, rows=m, seconds=float(torch.tensor(runs[(b, m)]).median()))
            for b, m in grid]


def fit_cost_model(samples: Sequence[ProfileSample], gamma: int, platform: str, tiers: Sequence[int] = (),
                   row_bins: Sequence[int] = (1, 8, 32, 64)) -> tuple[CostModel, FitReport, int | None]:
    """With tiers: TieredCostModel (one value per tier). Without: the additive model
    `bias + alpha(B) + theta(M)` at the finest M binning whose fit is valid (noisy timings can make the
    finest fit predict a non-positive time somewhere, which the model refuses; coarser bins average
    the noise out). Returns (model, report, row_bin used or None)."""
    if tiers:
        model, report = TieredCostModel.fit(samples, tiers=tiers, platform=platform, width=gamma + 1)
        return model, report, None
    errors = []
    for row_bin in row_bins:
        try:
            model, report = AdditiveCostModel.fit(samples, row_bin=row_bin, platform=platform, width=gamma + 1)
            return model, report, row_bin
        except ValueError as e:
            errors.append(f"row_bin={row_bin}: {e}")
    raise ValueError("no valid additive cost model fit: " + "; ".join(errors))
