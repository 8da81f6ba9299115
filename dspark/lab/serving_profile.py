"""Profile this machine's serving cost: the draft phase per depth, the drafter's catch-up, the prefill and the
KV term, measured on the real decode loop and assembled with the whole-step samples into a `ServingCost` the
policy lab replays with (`profiled_cost`, `profile_serving_cost`, `serving_cost_of_steps`); `ProfiledPlanners`
plans a live decoder with such a profile, each draft depth priced by its own draft.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from dspark.config import ScheduleConfig, VerifyMode
from dspark.cost import (
    CostModel,
    ProfileSample,
)
from dspark.cost.base import check_probes, check_samples
from dspark.cost.serving import BatchCurve, DraftCost, PrefillCost, ServingCost
from dspark.cost.shipped import ServingCostSpec, fill_monotone, fit_prefill, scale_batches, shift_batches
from dspark.cost.step import KV_LAYOUTS
from dspark.kernels import dispatch
from dspark.lab.profile import (
    ForcedRows,
    PlainStepCost,
    ProfileRuns,
    _median_step,
    fit_cost_model,
    profile_points,
    profile_step_costs,
)
from dspark.lab.timing import lockstep
from dspark.plan.planner import PlannerSettings, VerifyPlanner
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import FixedK
from dspark.util.validate import check_real, check_type


@dataclass(frozen=True)
class ServingProfile:
    """What a serving profile measured at its batch sizes (the input of `profiled_cost`).

    Args:
        samples: whole speculative steps (B, M, seconds) drafting gamma.
        plain: plain-step seconds per profiled B; drafting: the draft phase per profiled B for depths 1..gamma.
        prefill: the prefill fit (`fit_prefill`).
        catch_up: the drafter's seconds per token caught up beyond the roots (0: not profiled).
        kv: (seconds per cached KV token, the cached tokens per request the profiled steps held), or None (not
            profiled); kv_layout: how the profiled attention reads the KV cache (`attention_kv_layout`).
    """

    samples: Sequence[ProfileSample]
    plain: BatchCurve
    drafting: Sequence[BatchCurve]
    prefill: PrefillCost
    catch_up: float = 0.0
    kv: tuple[float, float] | None = None
    kv_layout: str = "ragged"

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", tuple(check_samples(self.samples)))
        check_type("plain", self.plain, BatchCurve)
        drafting = tuple(check_type("drafting", self.drafting, (list, tuple)))
        if not drafting:
            raise ValueError("drafting needs one curve per depth 1..gamma, got none")
        for k, curve in enumerate(drafting):
            check_type(f"drafting[{k}]", curve, BatchCurve)
        object.__setattr__(self, "drafting", drafting)
        check_type("prefill", self.prefill, PrefillCost)
        check_real("catch_up", self.catch_up, 0.0, math.inf, high_open=True)
        if self.kv is not None:
            if not isinstance(self.kv, tuple) or len(self.kv) != 2:
                raise ValueError(f"kv must be a (seconds per KV token, context tokens) pair or None, got {self.kv!r}")
            check_real("kv[0] (seconds per KV token)", self.kv[0], 0.0, math.inf, high_open=True)
            check_real("kv[1] (context tokens)", self.kv[1], 0.0, math.inf, high_open=True)
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")


def profile_drafting(decoder: SpecDecoder, prompts: Tensor, gamma: int, *, runs: ProfileRuns
                     ) -> tuple[list[float], list[tuple[int, float]], float]:
    """The draft phase per depth, the prefill and the drafter's catch-up of B = len(prompts) requests.

    Returns ([median draft phase of full-batch steps drafting k, verifying the roots only, for k = 1..gamma],
    [(prompt tokens, seconds) of each run's first admission], seconds per token caught up beyond the roots
    (`profile_catch_up`)): the median over `runs.repeats` runs of `runs.tokens` new tokens per depth."""
    check_type("runs", runs, ProfileRuns)
    b, drafting, prefills = prompts.shape[0], [], []
    for k in range(1, gamma + 1):
        results = [decoder.generate(prompts, runs.tokens, ForcedRows(k, b, b))
                   for _ in range(runs.repeats)]
        drafting.append(statistics.median(statistics.median(s.times.draft for s in r.steps
                                                            if s.requests.numel() == b) for r in results))
        prefills += [(int(prompts.shape[1] - 1) * b, r.startup_seconds) for r in results]
    catch_up = profile_catch_up(decoder, prompts, gamma, runs=runs)
    return drafting, prefills, catch_up


def profile_catch_up(decoder: SpecDecoder, prompts: Tensor, gamma: int, *, runs: ProfileRuns) -> float:
    """Seconds per token the drafter catches up beyond the roots, from `runs.repeats` runs (of `runs.tokens` new
    tokens) of B = len(prompts) requests drafting gamma and verifying every row: their steps catch up 0..gamma
    tokens per request (what the step committed beyond one) and the first the prompts. The least-squares slope of
    each step's draft phase over its catch-up tokens, clipped at 0."""
    check_type("runs", runs, ProfileRuns)
    b = prompts.shape[0]
    points = [(s.catch_up, s.times.draft) for _ in range(runs.repeats)
              for s in decoder.generate(prompts, runs.tokens, ForcedRows(gamma, b * (gamma + 1), b)).steps
              if s.speculated]
    x, y = np.array(points, dtype=np.float64).T
    if np.ptp(x) == 0:
        return 0.0
    return max(float(np.polyfit(x, y, 1)[0]), 0.0)


KV_REPEATS = 3  # lockstep short / long pairs per repeat of a point: the KV term is a small difference of step times


def profile_kv(decoder: SpecDecoder, short: Tensor, long: Tensor, *, runs: ProfileRuns) -> tuple[float, float, float]:
    """The KV term's evidence at B = len(short): plain runs (of `runs.tokens` new tokens) of B requests on short
    [B, P] and long [B, P'] prompts in lockstep, `KV_REPEATS * runs.repeats` pairs.

    Returns (extra seconds: the median over the pairs of the long run's median full-batch step minus the short
    run's; the extra cached tokens of a long step over a short one, summed over the B requests; the short runs'
    mean cached tokens per request over their full-batch steps)."""
    check_type("runs", runs, ProfileRuns)
    b, extra, tokens, base = short.shape[0], [], [], []
    for _ in range(KV_REPEATS * runs.repeats):
        results = lockstep({n: decoder.fork().start(p, runs.tokens, FixedK(0), mode=VerifyMode.STATIC)
                            for n, p in (("short", short), ("long", long))})
        full = {n: [s for s in r.steps if s.requests.numel() == b] for n, r in results.items()}
        kv = {n: statistics.fmean(s.kv_tokens for s in steps) for n, steps in full.items()}
        extra.append(_median_step(results["long"]) - _median_step(results["short"]))
        tokens.append(kv["long"] - kv["short"])
        base.append(kv["short"] / b)
    return statistics.median(extra), statistics.fmean(tokens), statistics.fmean(base)


def attention_kv_layout(device: torch.device) -> str:
    """How dspark's attention reads the KV cache on `device`: `ragged` (the Triton kernel walks each request's own
    length) or `padded` (the CPU torch path pads every request to the step's longest)."""
    return "ragged" if dispatch.use_triton(torch.empty(0, device=device)) else "padded"


def profile_serving_cost(decoders: Callable[[int], SpecDecoder], prompts: Tensor, batch_sizes: Sequence[int],
                         spec: ServingCostSpec, *, runs: ProfileRuns, long_prompts: Tensor | None = None,
                         progress: Callable[[str], None] | None = None) -> ServingCost:
    """A ServingCost of this machine, profiled with the engine's own code at each B of `batch_sizes`.

    Per B: whole speculative steps at every tier top in [B, B x W] and plain steps (`profile_step_costs`), the
    draft phase per depth, the prefill and the drafter's catch-up per token (`profile_drafting`; the catch-up's
    median over B); fitted and extended by `profiled_cost`.

    Args:
        decoders: b -> the SpecDecoder to profile B = b on (one per B keeps memory bounded; its config reserves the
            timed runs' new tokens).
        prompts: [N >= max B, P] held-out prompts of one length.
        batch_sizes: the profiled B (strictly increasing).
        spec: the cost's name, description, gamma, max_requests, tier ladder (up to max_requests x W) and
            parameters.
        runs: tokens per run and repeats per point.
        long_prompts: [N, P' > P]: with them the KV term is profiled too (`profile_kv` per B, pooled: the extra
            seconds summed over B divided by the extra tokens summed over B, clipped at 0, so the largest B, whose
            difference stands furthest above the timing noise, weighs most), else it is 0.
        progress: called with a line after each B.
    """
    check_type("spec", spec, ServingCostSpec)
    check_type("runs", runs, ProfileRuns)
    batch_sizes = check_probes("batch_sizes", batch_sizes, 1)
    gamma, tiers = spec.gamma, spec.tiers
    samples, plain, prefills, kv_evidence, catch_ups = [], [], [], [], []
    drafting: list[list[float]] = [[] for _ in range(gamma)]
    layout = "ragged"
    for b in batch_sizes:
        decoder = decoders(b)
        layout = attention_kv_layout(decoder.device)
        measured, plain_b = profile_step_costs(decoder, prompts[:b], profile_points([b], gamma, tiers), gamma,
                                               runs=runs)
        samples += measured
        plain.append(plain_b.seconds[0])
        depths, admissions, catch_up = profile_drafting(decoder, prompts[:b], gamma, runs=runs)
        for k, seconds in enumerate(depths):
            drafting[k].append(seconds)
        prefills += admissions
        catch_ups.append(catch_up)
        if long_prompts is not None:
            kv_evidence.append(profile_kv(decoder, prompts[:b], long_prompts[:b], runs=runs))
        if progress:
            progress(f"profiled B={b}")
    kv = None
    if kv_evidence:
        extra, tokens, contexts = zip(*kv_evidence)
        kv = (max(sum(extra) / sum(tokens), 0.0), statistics.fmean(contexts))
    profile = ServingProfile(samples, BatchCurve(batch_sizes, plain), [BatchCurve(batch_sizes, d) for d in drafting],
                             fit_prefill(prefills), catch_up=statistics.median(catch_ups), kv=kv, kv_layout=layout)
    return profiled_cost(profile, spec)


def serving_cost_of_steps(decoder: SpecDecoder, prompts: Tensor, steps: tuple[list[ProfileSample], PlainStepCost],
                          batch_sizes: Sequence[int], spec: ServingCostSpec, *, runs: ProfileRuns,
                          progress: Callable[[str], None] | None = None) -> ServingCost:
    """Whole and plain steps already profiled on `decoder` as a ServingCost: the draft phase per depth, the prefill
    and the drafter's catch-up measured here (`profile_drafting`) at each B of `batch_sizes`.

    Args:
        decoder: the SpecDecoder the steps were profiled on.
        prompts: [N >= max B, P] the held-out prompts they were profiled with.
        steps: (`profile_step_costs`' samples drafting spec.gamma, its PlainStepCost covering `batch_sizes`).
        batch_sizes: the B to profile the draft at (strictly increasing, from 1; the cost covers 1..spec.max_requests).
        spec: the cost's name, description, gamma, max_requests, tier ladder and parameters.
        runs: tokens per run and repeats per point.
        progress: called with a line after each B.
    """
    check_type("spec", spec, ServingCostSpec)
    check_type("runs", runs, ProfileRuns)
    samples, plain = steps
    batch_sizes = check_probes("batch_sizes", batch_sizes, 1)
    if batch_sizes[0] != 1:
        raise ValueError(f"batch_sizes must start at 1 (the cost covers B = 1..max_requests), got {list(batch_sizes)}")
    drafting: list[list[float]] = [[] for _ in range(spec.gamma)]
    prefills, catch_ups = [], []
    for b in batch_sizes:
        depths, admissions, catch_up = profile_drafting(decoder, prompts[:b], spec.gamma, runs=runs)
        for k, seconds in enumerate(depths):
            drafting[k].append(seconds)
        prefills += admissions
        catch_ups.append(catch_up)
        if progress:
            progress(f"profiling the draft per depth, B={b}")
    profile = ServingProfile(samples, BatchCurve(tuple(batch_sizes), [plain.step_seconds(b) for b in batch_sizes]),
                             [BatchCurve(tuple(batch_sizes), d) for d in drafting], fit_prefill(prefills),
                             catch_up=statistics.median(catch_ups), kv_layout=attention_kv_layout(decoder.device))
    return profiled_cost(profile, spec)


@dataclass(frozen=True)
class ProfiledPlanners:
    """The VerifyPlanners of a live decoder planning with this machine's profile: `planners(b, sts, depth)` for
    B = b requests drafting `depth` tokens (default gamma), with the STS temperatures when `sts`.

    Args:
        cost: the profiled whole-step table, drafting gamma (its W = gamma + 1) (depth gamma's belief).
        serving: the ServingCost of the same profile (a shallower depth's belief: its target part plus that depth's
            draft, `believed(depth, 0.0)`); None: depth gamma only.
        decoder: the SpecDecoder served (its graph tiers and slots).
        temperatures: STS per position (gamma values).
        settings: the planners' lag, ring slots and live argmax (`PlannerSettings`; tiers and graph slots come
            from the decoder).
    """

    cost: CostModel
    serving: ServingCost | None
    decoder: SpecDecoder
    temperatures: Sequence[float]
    settings: PlannerSettings

    def __call__(self, b: int, sts: bool = True, depth: int | None = None) -> VerifyPlanner:
        gamma = self.cost.width - 1
        depth = gamma if depth is None else depth
        believed = self.cost if depth == gamma else self.serving.believed(depth, 0.0)
        planning = dataclasses.replace(self.settings, tiers=self.decoder.tiers or None,
                                       graph_slots=self.decoder.graph_slots(b, depth + 1))
        return VerifyPlanner(ScheduleConfig(gamma=depth), believed, planning,
                             temperatures=list(self.temperatures)[:depth] if sts else None)


def profiled_cost(profile: ServingProfile, spec: ServingCostSpec) -> ServingCost:
    """A ServingCost from a profile's results (`ServingProfile`) and what the cost is (`ServingCostSpec`).

    `fit_cost_model` over the profiled tiers of the spec's ladder, `fill_monotone`, `scale_batches` up to
    spec.max_requests, then the gamma-deep draft taken out of every cell (`verify` holds the target's part); the
    draft curves made non-decreasing in the depth. With profile.kv: per_kv_token, and the profiled context's share
    taken out of verify and plain (the file then prices each step's own context); without: per KV token 0, the
    profile's contexts inside the table.

    Args:
        profile: whole-step samples drafting spec.gamma, plain seconds and the draft phase per depth 1..spec.gamma
            at the profiled B, the prefill fit, the catch-up and KV terms.
        spec: the cost's name, description, gamma, max_requests, tier ladder and parameters.
    """
    import platform

    check_type("profile", profile, ServingProfile)
    check_type("spec", spec, ServingCostSpec)
    if len(profile.drafting) != spec.gamma:
        raise ValueError(f"profile.drafting needs one curve per depth 1..gamma = {spec.gamma}, got "
                         f"{len(profile.drafting)}")
    samples, plain, drafting, prefill = profile.samples, profile.plain, profile.drafting, profile.prefill
    kv, catch_up, kv_layout = profile.kv, profile.catch_up, profile.kv_layout
    gamma, tiers, max_requests = spec.gamma, spec.tiers, spec.max_requests
    machine, top = f"{platform.machine()}-cpu", plain.batch_sizes[-1]
    fitted = fit_cost_model(samples, gamma, platform=machine, tiers=[t for t in tiers if t <= top * (gamma + 1)])[0]
    model, curves = scale_batches(fill_monotone(fitted, samples), (plain, *drafting), tiers, max_requests)
    plain, drafting = curves[0], curves[1:]
    per_kv, context = kv or (0.0, 0.0)
    # the KV slope comes from other runs than the plain steps: under timing noise it is held so that the profiled
    # context's share is at most half of every plain step (a plain step is never priced at or below zero)
    kv_most = min(0.5 * s / (context * b) for b, s in zip(plain.batch_sizes, plain.seconds)) if context else per_kv
    kv_held = per_kv > kv_most
    per_kv = min(per_kv, kv_most)
    drafting = [BatchCurve(c.batch_sizes, np.maximum.reduce([d.seconds for d in drafting[: k + 1]]).tolist())
                for k, c in enumerate(drafting)]  # a deeper proposal never costs less than a shallower one
    # the priced gamma-deep draft taken out: a gamma-deep step prices at the measured whole step. The draft phase
    # comes from other runs than the whole steps, so where timing noise makes it exceed a step's cheapest cell the
    # part taken out is held to half that cell (the target's share of a step is never priced at or below zero)
    cheapest = {b: min(float(model.step_seconds(b, m)) for m in range(b, b * (gamma + 1) + 1))
                for b in model.batch_probes}
    taken = [drafting[-1](b) + per_kv * context * b for b in model.batch_probes]
    held = [min(t, 0.5 * cheapest[b]) for b, t in zip(model.batch_probes, taken)]
    verify = shift_batches(model, [-h for h in held])
    plain = BatchCurve(plain.batch_sizes, [t - per_kv * context * b for b, t in zip(plain.batch_sizes, plain.seconds)])
    sources = (
        "measured: dspark.lab.profile.profile_step_costs per batch size + fit_cost_model over the tier ladder "
        "(TieredCostModel table over its serving tiers; plain step per B)",
        "unmeasured table cells made monotone in the tier (fill_monotone)",
        f"B > {top}: B / {top} steps of {top} requests with the same rows per request (scale_batches)",
        "drafter: median draft phase of full-batch steps drafting k = 1..gamma, verifying the roots only "
        "(ForcedRows k, M = B), made non-decreasing in k; verify = the profiled step minus the gamma-deep draft; "
        + (f"catch-up: profile_catch_up, {catch_up * 1e6:.3f} us per token beyond the roots" if catch_up else
           "catch-up: not profiled (0)"),
        (f"per KV token ({kv_layout}): profile_kv, plain steps on short and long prompts in lockstep, pooled over B, "
         f"{per_kv * 1e6:.3f} us; the profiled steps' {context:.1f} cached tokens per request taken out of verify and plain" if kv else
         "per KV token: 0 (the profiled steps hold the profile's own contexts)")
        + "; prefill: fit_prefill over the drafting runs' first admissions",
        f"machine: {platform.platform()}, torch {torch.__version__}")
    if kv_held:
        sources += (f"the KV slope held to {per_kv * 1e6:.3f} us: half of the smallest plain step per profiled "
                    f"context token (timing noise)",)
    if held != taken:
        sources += (f"the draft taken out held to half the cheapest cell at B = "
                    f"{[b for b, h, t in zip(model.batch_probes, held, taken) if h != t]} (timing noise)",)
    drafter = DraftCost("chain", tuple(drafting), catch_up)
    return ServingCost(spec.name, machine, spec.description, sources, verify, plain, per_kv, drafter, prefill,
                       tiers=model.tiers, max_requests=max_requests, parameters=spec.parameters, kv_layout=kv_layout)
