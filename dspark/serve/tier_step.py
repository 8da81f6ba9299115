"""VerifyStep: the target's verify forward as one capturable step, replayed per token tier by `TierGraphRunner`.

A verify step padded to a tier has a static shape: the token ids and positions of the tier's rows go in,
the final hidden states and logits of the same rows come out. The step function reads only the runner's
`StepBuffers` and the persistent buffers of the step's own `RaggedVerifyAttention` (sized for the largest
tier, at most W rows per slot, so a captured launch fits every layout of its tier). The attention's `plan`
(host work: validation, the step's geometry copied into those buffers) runs in the runner's `prepare` hook
before each capture and replay, so the captured forward does no host work: CUDA graphs on a GPU, eager at
the padded tier shape on the CPU. Padding rows sit in ghost slots with KV slot -1 and never write the
cache. A layout past the largest tier runs the same forward eagerly on its unpadded rows (the runner logs
why and counts it). `dspark.lab.sweep.VerifyStepAdapter` drives the same step for the tier sweep, so the cost
tables profile exactly what the engine replays.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from dspark.models.paged_attend import PlannedAttend
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve.kv_cache import PagedKVCache
from dspark.util.validate import check_int, check_type
from dspark.verify import boundary
from dspark.verify.attention import AttentionShape, RaggedVerifyAttention
from dspark.verify.graphs import GraphBackend, RowSpec, StepBuffers, TierGraphRunner, TierSpec
from dspark.verify.layout import RaggedVerifyLayout, check_tiers

ROW_INPUTS: dict[str, RowSpec] = {"tokens": ((), torch.int64), "positions": ((), torch.int64)}
COMPILE_BACKEND = "inductor"  # torch.compile's backend for compile_model (tests count compiles with their own)


def model_rows(target: TransformersCausalLM, attend: PlannedAttend, tokens: Tensor, positions: Tensor
               ) -> tuple[Tensor, Tensor]:
    """Final hidden states and logits of packed rows (what `compile_model` compiles)."""
    hidden = target(tokens, positions, attend)
    return hidden, target.logits(hidden)


@functools.lru_cache(maxsize=None)
def compiled_model_rows(backend: str | Callable[..., object]) -> Callable[..., tuple[Tensor, Tensor]]:
    """`model_rows` under one `torch.compile` for every verify step, tier and target of the process, its row
    dimension dynamic from the first compile (`dynamic=True`): a new tier, a new step (another width or
    page count) or an eager step past the largest tier reuses the graphs instead of recompiling against the
    recompile limit (8 per function, after which torch.compile silently runs eager). Every layer runs the
    same graphs (`transformers_lm` reads the layer index outside the compile)."""
    return torch.compile(model_rows, backend=backend, dynamic=True)


def graph_slot_count(max_requests: int, tiers: Sequence[int], width: int) -> int:
    """Slots of a tier-padded step: the real requests plus enough ghost slots (<= W rows each) for the
    largest possible padding, so every tier holds any batch of up to `max_requests` requests."""
    return max_requests + -(-check_tiers(tiers)[-1] // width)


@dataclass(frozen=True)
class VerifyStepShape:
    """What a `VerifyStep` is sized for, checked when built: up to `max_requests` requests of <= `width` rows
    each, captured once per tier of `tiers` (at least one) with `graph_slots` slots (one, or one per tier; default
    `graph_slot_count(max_requests, tiers, width)`; kept as one per tier)."""

    tiers: Sequence[int]
    width: int
    max_requests: int
    graph_slots: int | Sequence[int] | None = None

    def __post_init__(self) -> None:
        check_int("width", self.width, 1)
        check_int("max_requests", self.max_requests, 1)
        tiers = check_tiers(self.tiers)
        if not tiers:
            raise ValueError("tiers must hold at least one token tier to capture, got none")
        slots = graph_slot_count(self.max_requests, tiers, self.width) if self.graph_slots is None else self.graph_slots
        object.__setattr__(self, "tiers", tiers)
        object.__setattr__(self, "graph_slots", TierSpec(tiers, slots, self.width).slots)

    @property
    def tier_spec(self) -> TierSpec:
        """What the step's runner captures: these tiers, slots and W."""
        return TierSpec(self.tiers, self.graph_slots, self.width)


class VerifyOutput(NamedTuple):
    """The real rows of one verify forward."""

    hidden: Tensor     # [total_rows, d] final-normed hidden states
    logits: Tensor     # [total_rows, V]
    positions: Tensor  # [total_rows] int64 absolute positions


class VerifyStep:
    """The target's verify forward over `cache` for the requests, rows and tiers of `shape` (`VerifyStepShape`),
    captured once per tier (the runner is `self.runner`; its replay / eager counts are the telemetry of which
    tier each step replayed).

    `cache.block_table` must be admitted (its page count per request sizes the attention's block table).
    compile_model: run the model's dense layers (everything but the attention, which stays the planned
    kernel) through `compiled_model_rows`: one torch.compile with a dynamic row dimension shared by every
    step and tier (each tier is then captured from the same graphs), compiled at the first forward (a graph
    backend's first capture, the eager backend's first step); default True on CUDA, False elsewhere.
    """

    def __init__(self, target: TransformersCausalLM, cache: PagedKVCache, shape: VerifyStepShape, *,
                 backend: GraphBackend | None = None, model_id: str = "", compile_model: bool | None = None) -> None:
        check_type("shape", shape, VerifyStepShape)
        if compile_model is not None and not isinstance(compile_model, bool):
            raise TypeError(f"compile_model must be a bool or None, got {compile_model!r}")
        tiers, width, max_requests = shape.tiers, shape.width, shape.max_requests
        if cache.block_table.dim() != 2 or cache.block_table.shape[1] < 1:
            raise ValueError(f"cache has no admitted block table (shape {list(cache.block_table.shape)}): "
                             f"admit the batch before building its verify step")
        g, device = target.geometry, cache.k.device
        _, num_pages, page_size, kv_heads, head_dim = cache.k.shape
        pages_per_request = int(cache.block_table.shape[1])
        max_slots = max(max_requests, *shape.graph_slots)
        self.target, self.device, self.shape = target, device, shape
        attention = target.attention_backend or RaggedVerifyAttention  # the target's attention backend
        sized = AttentionShape(max(tiers[-1], max_requests * width), max_slots, pages_per_request, g.num_q_heads,
                               kv_heads, head_dim, page_size, sm_scale=g.sm_scale, max_verify_len=width,
                               num_pages=num_pages)
        self.attn = attention(sized, device, cache.k.dtype)
        self._attend = PlannedAttend(self.attn, cache.k, cache.v)
        self.compile_model = device.type == "cuda" if compile_model is None else compile_model
        # what `_plan` plans with: no request for the idle layouts of the captures, then each step's own
        self._context = (torch.zeros(0, dtype=torch.int64),
                         torch.zeros(0, pages_per_request, dtype=torch.int32, device=device))
        if device.type == "npu" and backend is None:
            import dspark.ascend  # noqa: F401  (registers the NPU graph backend)
        self.runner = TierGraphRunner(self._forward, shape.tier_spec, device, backend, row_inputs=ROW_INPUTS,
                                      model_id=model_id, prepare=self._plan).capture()

    def __call__(self, tokens: Tensor, layout: RaggedVerifyLayout, prefix_lens: Tensor,
                 block_table: Tensor) -> VerifyOutput:
        """Verify the packed rows `tokens [>= total_rows]` of `layout` (built with the runner's tiers and slots:
        `self.runner.layout`, or `RaggedVerifyLayout.from_verify_lens(lens, tiers, graph_slots, width=W)`);
        prefix_lens [B]: tokens already cached per request; block_table [B, P]: their pages. On a replay the
        outputs are views of the tier's static buffers, valid until that tier's next step."""
        positions = self.bind(layout, prefix_lens, block_table)
        out = self.runner.run(layout, tokens=tokens, positions=positions)  # the real rows
        return VerifyOutput(out["hidden"], out["logits"], positions[: layout.total_rows])

    def bind(self, layout: RaggedVerifyLayout, prefix_lens: Tensor, block_table: Tensor) -> Tensor:
        """Set the requests the next `runner.run(layout, tokens=, positions=)` attends over (prefix_lens [B] cached
        tokens, block_table [B, P] their pages); returns the rows' positions [>= total_rows] int64."""
        self._context = (prefix_lens, block_table)
        return layout.positions(boundary.to_device(prefix_lens, self.device, torch.int64))

    def _plan(self, layout: RaggedVerifyLayout) -> None:
        """The runner's `prepare` hook: the attention's host-side plan for the layout about to run."""
        self.attn.plan(layout, *self._context)

    def _forward(self, bufs: StepBuffers) -> dict[str, Tensor]:
        tokens, positions = bufs.rows["tokens"], bufs.rows["positions"]
        if self.compile_model:
            hidden, logits = compiled_model_rows(COMPILE_BACKEND)(self.target, self._attend, tokens, positions)
        else:
            hidden = self.target(tokens, positions, self._attend)
            logits = self.target.logits(hidden)
        return {"hidden": hidden, "logits": logits}


class VerifySteps:
    """A decoder's verify steps over one target and cache, captured once per (B, W, pages per request) and
    reused by every later run of that shape (captures are the expensive part on a GPU)."""

    def __init__(self, target: TransformersCausalLM, cache: PagedKVCache, tiers: Sequence[int],
                 compile_model: bool | None = None) -> None:
        self.target, self.cache, self.tiers = target, cache, check_tiers(tiers)
        self.compile_model = compile_model
        self._steps: dict[tuple[int, int, int], VerifyStep] = {}

    def get(self, max_requests: int, width: int) -> VerifyStep | None:
        """The step for the batch admitted in the cache; None without tiers or drafts (W = 1: no verify step)."""
        if not self.tiers or width == 1:
            return None
        key = (max_requests, width, int(self.cache.block_table.shape[1]))
        if key not in self._steps:
            self._steps[key] = VerifyStep(self.target, self.cache, VerifyStepShape(self.tiers, width, max_requests),
                                          compile_model=self.compile_model)
        return self._steps[key]
