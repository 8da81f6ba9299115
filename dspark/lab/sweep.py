"""Measure verify-step cost and judge cost models by the budgets they choose.

Sweep: which (B, rows) points to pin, and a timed, interleaved sweep of a `StepAdapter` (the built-in one
is `VerifyStepAdapter`: the engine's own verify step over a transformers model).

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
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.plan.budget import choose_budget, tau_curve
from dspark.serve.clock import CLOCKS, step_timer
from dspark.serve.kv_cache import PagedKVCache
from dspark.serve.tier_step import VerifyStep, VerifyStepShape
from dspark.util.validate import check_int, check_type
from dspark.verify.graphs import GraphBackend
from dspark.verify.layout import check_tiers, round_up_to_tier, split_rows

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


def dense_rows(num_requests: int, width: int, floor: int = 1) -> list[int]:
    """Every row count a step with B requests can have: [B*F, B*W]."""
    lo, hi = _row_range(num_requests, width, floor)
    return list(range(lo, hi + 1))


STATS: dict[str, Callable[[list[float]], float]] = {"median": statistics.median, "min": min}


@dataclass(frozen=True)
class SweepTiming:
    """How `profile_steps` times each point.

    Args:
        warmup: untimed steps right before each timed one.
        repeats: passes over all points, each in a fresh random order drawn from `seed`.
        inner: steps per timing (their mean is one repeat's value; averages out sub-step jitter).
        clock: see `step_timer` (`thread`: CPU only).
        stat: `median` over repeats, or `min` (contention on a shared machine only ever slows a step down).
    """

    warmup: int = 1
    repeats: int = 5
    inner: int = 1
    seed: int = 0
    clock: str = "wall"
    stat: str = "median"

    def __post_init__(self) -> None:
        check_int("warmup", self.warmup, 0)
        check_int("repeats", self.repeats, 1)
        check_int("inner", self.inner, 1)
        check_int("seed", self.seed, 0)
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {self.clock!r}")
        if self.stat not in STATS:
            raise ValueError(f"stat must be one of {sorted(STATS)}, got {self.stat!r}")


def profile_steps(adapter: StepAdapter, points: Sequence[tuple[int, int]], *, timing: SweepTiming = SweepTiming(),
                  progress: Callable[[int, int], None] | None = None) -> list[ProfileSample]:
    """Seconds of `adapter.step()` at each (num_requests, rows) point, in the order given: `timing.stat` (the
    median by default) over `timing.repeats` interleaved passes.

    progress(done, total) is called after each timed step.
    """
    check_type("timing", timing, SweepTiming)
    warmup, repeats, inner, seed, clock, stat = (timing.warmup, timing.repeats, timing.inner, timing.seed,
                                                 timing.clock, timing.stat)
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


@dataclass(frozen=True)
class SweepCache:
    """The paged KV cache a swept verify step attends over: `context` cached tokens per request (random K/V) in
    pages of `page_size` tokens; `seed` draws the cache and each step's random token ids."""

    context: int = 32
    page_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("context", 0), ("page_size", 1), ("seed", 0)):
            check_int(name, getattr(self, name), low)


class VerifyStepAdapter:
    """`dspark.lab.sweep.StepAdapter` for a target's `VerifyStep`: the engine's verify forward of B requests
    over `cache.context` cached tokens each (random token ids, random cached K/V), padded to its tier.

    Args:
        target: the model whose verify step is swept (moved to `device`).
        shape: the step's tiers, width W, max_requests and graph slots (`VerifyStepShape`).
        cache: the cached context, its page size and the seed of the random inputs (`SweepCache`).
        device / backend / compile_model: as for `VerifyStep`.
        name: what the sweep's files are called after (default `<model_type>-L<layers>-d<hidden>-ctx<context>`).
    """

    def __init__(self, target: TransformersCausalLM, shape: VerifyStepShape, cache: SweepCache = SweepCache(), *,
                 device: torch.device | str = "cpu", backend: GraphBackend | None = None, name: str | None = None,
                 compile_model: bool | None = None) -> None:
        check_type("shape", shape, VerifyStepShape)
        check_type("cache", cache, SweepCache)
        width, max_requests, context, page_size = shape.width, shape.max_requests, cache.context, cache.page_size
        g, self.device = target.geometry, torch.device(device)
        if context + width > g.max_seq_len:
            raise ValueError(f"context {context} + width {width} exceeds the target's max_seq_len {g.max_seq_len}")
        hf = target.hf_model.config
        self.name = name or f"{hf.model_type}-L{g.num_layers}-d{g.hidden_size}-ctx{context}"
        self.target = target.to(self.device)
        per_request = -(-(context + width) // page_size)
        self.cache = PagedKVCache(num_layers=g.num_layers, num_heads=g.num_kv_heads, head_dim=g.head_dim,
                                  num_pages=max_requests * per_request, page_size=page_size, device=self.device,
                                  dtype=target.hf_model.dtype)
        self.cache.admit(max_requests, context + width)
        self._gen = torch.Generator().manual_seed(cache.seed)
        for buf in (self.cache.k, self.cache.v):
            buf.copy_(torch.randn(buf.shape, generator=self._gen))
        self.verify = VerifyStep(target, self.cache, shape, backend=backend, model_id=self.name,
                                 compile_model=compile_model)
        self.runner = self.verify.runner
        self.context, self.width, self.max_requests = context, width, max_requests
        self._step: tuple | None = None

    def prepare(self, num_requests: int, rows: int) -> None:
        if num_requests > self.max_requests:
            raise ValueError(f"num_requests={num_requests} exceeds max_requests={self.max_requests}")
        layout = self.runner.layout(split_rows(num_requests, rows, self.width))
        tokens = torch.randint(0, self.target.geometry.vocab_size, (rows,), generator=self._gen).to(self.device)
        prefix = torch.full((num_requests,), self.context, dtype=torch.int64)
        self._step = (tokens, layout, prefix, self.cache.block_table[:num_requests])

    def step(self) -> None:
        if self._step is None:
            raise RuntimeError("call prepare(num_requests, rows) before step()")
        self.verify(*self._step)
