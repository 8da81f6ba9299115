"""A roofline step time for any decoder geometry: what one forward streams from HBM and computes, priced on an
accelerator.

One forward over `rows` verify rows of `requests` requests, each attending `context` KV tokens, costs

    max(weight bytes / (bandwidth x memory_efficiency), FLOPs(rows) / (peak x compute_efficiency))
    + KV-read bytes / (bandwidth x memory_efficiency) + launch_units x layer_floor

FLOPs(rows) = 2 x parameter uses per row x rows + 4 x attention width x context x rows (QK^T and PV). The
weights are read once per forward whatever the rows (memory-bound: flat in the rows), the FLOPs grow with them
(compute-bound past `knee_rows`). The embedding lookup reads only the rows' embeddings, so a decoder streams its
layers and its LM head (tied or not). Constants and their sources: graphs/cost_models/README.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from dspark.util.validate import check_int, check_real


@dataclass(frozen=True)
class Accelerator:
    """A device as the roofline sees it: bytes / s, dense FLOP / s at the weights' dtype, the achievable
    fractions of both, and the seconds per launch unit (a layer's kernels) however small the work."""

    name: str
    memory_bandwidth: float
    peak_flops: float
    memory_efficiency: float
    compute_efficiency: float
    layer_floor: float

    def __post_init__(self) -> None:
        for name in ("memory_bandwidth", "peak_flops", "layer_floor"):
            check_real(name, getattr(self, name), 0.0, math.inf, low_open=True, high_open=True)
        for name in ("memory_efficiency", "compute_efficiency"):
            check_real(name, getattr(self, name), 0.0, 1.0, low_open=True)

    def stream_seconds(self, forward: "Forward", rows: int, context: int) -> float:
        """max(weight stream, compute) seconds of `rows` rows attending `context` KV tokens each."""
        weights = forward.weight_params * forward.dtype_bytes / (self.memory_bandwidth * self.memory_efficiency)
        return max(weights, rows * self.row_seconds(forward, context))

    def row_seconds(self, forward: "Forward", context: int) -> float:
        """Compute seconds one row adds once the forward is compute-bound."""
        flops = 2 * forward.param_uses_per_row + 4 * forward.attention_width * context
        return flops / (self.peak_flops * self.compute_efficiency)

    def kv_seconds(self, forward: "Forward", requests: int, context: int) -> float:
        """Seconds to read `requests` x `context` tokens of KV cache."""
        kv = requests * context * forward.kv_width * forward.dtype_bytes
        return kv / (self.memory_bandwidth * self.memory_efficiency)

    def floor_seconds(self, forward: "Forward") -> float:
        """The launch floor: launch units x layer_floor."""
        return forward.launch_units * self.layer_floor

    def forward_seconds(self, forward: "Forward", *, rows: int, requests: int, context: int) -> float:
        """Seconds of one forward: rows >= 1 verify rows of requests >= 0 requests, context >= 0 KV tokens each."""
        check_int("rows", rows, 1)
        check_int("requests", requests, 0)
        check_int("context", context, 0)
        return (self.stream_seconds(forward, rows, context) + self.kv_seconds(forward, requests, context)
                + self.floor_seconds(forward))

    def knee_rows(self, forward: "Forward", context: int) -> float:
        """Rows where the compute time overtakes the weight stream (memory-bound below, compute-bound above)."""
        return self.stream_seconds(forward, 0, context) / self.row_seconds(forward, context)


@dataclass(frozen=True)
class Forward:
    """One forward as the roofline prices it: parameters streamed once, parameter uses per row (2 FLOPs each),
    attention width (sum over layers of heads x head dim), KV width (sum over layers of 2 x KV heads x head dim:
    values per context token), launch units (layers paying the floor), bytes per weight / KV value."""

    weight_params: int
    param_uses_per_row: int
    attention_width: int
    kv_width: int
    launch_units: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for f in fields(self):
            check_int(f.name, getattr(self, f.name), 1)


@dataclass(frozen=True)
class LlamaGeometry:
    """A Llama-shaped decoder: layers, hidden size, MLP intermediate size, query / KV heads, head dim, vocabulary
    (the LM head's rows)."""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    def __post_init__(self) -> None:
        for f in fields(self):
            check_int(f.name, getattr(self, f.name), 1)

    def forward(self) -> Forward:
        """Per layer q, k, v, o projections and a gated MLP (3 matrices), then the LM head."""
        attn = self.num_heads * self.head_dim
        layer = 2 * self.hidden * attn + 2 * self.hidden * self.num_kv_heads * self.head_dim
        params = self.num_layers * (layer + 3 * self.hidden * self.intermediate) + self.vocab * self.hidden
        return Forward(params, params, self.num_layers * attn,
                       self.num_layers * 2 * self.num_kv_heads * self.head_dim, self.num_layers)


@dataclass(frozen=True)
class BlockDraftGeometry:
    """dspark's block draft (`dspark.models.draft.DraftModel`): one decoder block over [target hidden, token
    embedding] (fuse 2d -> d), then a chain of gated MLP steps (2d -> 2 x chain -> d), each scored over the
    reduced draft vocabulary; `block` is the most drafts one forward proposes."""

    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    chain: int
    draft_vocab: int
    block: int

    def __post_init__(self) -> None:
        for f in fields(self):
            check_int(f.name, getattr(self, f.name), 1)

    def forward(self, gamma: int) -> Forward:
        """The draft proposing gamma drafts: the block once, gamma - 1 chain steps, gamma draft-vocab scorings;
        launch units: the block and one per draft."""
        if check_int("gamma", gamma, 1) > self.block:
            raise ValueError(f"gamma must be in [1, {self.block}] (the draft proposes at most {self.block} tokens "
                             f"per forward), got {gamma}")
        d, attn, kv = self.hidden, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        block = 2 * d * d + 2 * d * attn + 2 * d * kv + 3 * d * self.intermediate
        chain, scoring = 2 * d * 2 * self.chain + self.chain * d, self.draft_vocab * d
        return Forward(block + chain + scoring, block + (gamma - 1) * chain + gamma * scoring, attn, 2 * kv, 1 + gamma)
