"""Drafters: what proposes the k tokens a step verifies (`Drafter`, `Drafts`).

A drafter proposes exactly k tokens per request with, per position, either a confidence logit
(`source="head"`: a trained head, or the drafter's own raw belief) or the features the online estimator reads
(`source="features"`, [B, k, 3]), whichever the policy asks for; under sampling also the distributions q the
tokens were drawn from (one-hot for a deterministic proposer), so rejection sampling stays lossless. It
catches up on tokens committed without it (plain steps, refills) by itself, from the batch's lengths.

A drafter given to `SpecDecoder` is a description: the decoder checks it against its target
(`check_target`: vocabulary, tokenizer, geometry) and `bind`s a copy of it to itself (its own KV cache, on
the decoder's device), once per decoder and once per `fork`. The live engine, the lockstep demo and the trace
replay drive drafters through this interface only. The drafters: `block.BlockDrafter` (the block draft we
ship), `ngram.NgramDrafter` (prompt lookup) and `causal_lm.CausalLMDrafter` (a small causal LM); docs/drafters.md.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from dspark.models.geometry import ModelGeometry
from dspark.serve.attention import batch_attention
from dspark.serve.kv_cache import PagedKVCache
from dspark.serve.sampling import Sampling
from dspark.serve.scheduler import Batch
from dspark.verify import boundary
from dspark.verify.layout import RaggedVerifyLayout

if TYPE_CHECKING:
    from dspark.models.transformers_lm import TransformersCausalLM
    from dspark.serve.runner import LiveTarget

Source = Literal["head", "features"]


@dataclass
class Drafts:
    """One step's proposals for B requests (device tensors)."""

    tokens: Tensor                          # [B, k] int64 proposed tokens
    probs: Tensor | None = None             # [B, k, V] the distributions they were drawn from (sampling)
    confidence_logits: Tensor | None = None  # [B, k] the drafter's own head (source "head")
    features: Tensor | None = None          # [B, k, F] the online estimator's inputs (source "features")
    logits: Tensor | None = None            # [B, k, V] token logits (telemetry: the top-2 margin baseline)
    catch_up: int = 0                       # tokens the drafter's forward caught up beyond the B roots

    def spread(self, rows: Tensor, b: int) -> Drafts:
        """These proposals of some of a step's requests laid out over all `b` of them: rows [n] int64 (device) are
        the drafting requests' positions in the step. A request that did not draft gets token 0 (drawn from a
        one-hot q, so rejection sampling stays lossless), confidence -inf (survival 0: a plan verifies its root
        only), zero features and logits."""
        def full(x: Tensor | None, fill: float) -> Tensor | None:
            if x is None:
                return None
            out = x.new_full((b, *x.shape[1:]), fill)
            out[rows] = x
            return out
        probs = self.probs
        if probs is not None:
            probs = probs.new_zeros(b, *probs.shape[1:])
            probs[:, :, 0] = 1.0
            probs[rows] = self.probs
        return Drafts(full(self.tokens, 0), probs, full(self.confidence_logits, -math.inf), full(self.features, 0.0),
                      full(self.logits, 0.0), self.catch_up)


class Drafter:
    """The plug-in point for proposals.

    max_drafts: the most tokens one `propose` can return (None: any k). max_seq_len: the longest sequence it
    can draft for (None: no limit of its own)."""

    max_drafts: int | None = None
    max_seq_len: int | None = None

    def check_target(self, target: TransformersCausalLM, tokenizer: Any = None) -> None:
        """Raise ValueError when this drafter cannot draft for `target` (another vocabulary, geometry, or a
        tokenizer other than `tokenizer`, the target's, when both are known)."""

    def bind(self, states: LiveTarget, *, pages: int, page_size: int, device: torch.device) -> Drafter:
        """A copy of this drafter for one decoder: its KV cache of `pages` pages of `page_size` tokens on
        `device`; `states`: the decoder's target (its `model`, and the `hidden` states it keeps)."""
        return copy.copy(self)

    def start(self, batch: Batch, max_rows: int) -> None:
        """A run begins on `batch`; no request catches up more than `max_rows` tokens in one `propose`."""

    def admit(self, slots: Tensor) -> None:
        """New requests took `slots` (host ids); their prompts are in the batch."""

    def propose(self, batch: Batch, slots: Tensor, k: int, source: Source, sampling: Sampling) -> Drafts:
        """k >= 1 proposals for the requests in `slots` (host ids, ascending)."""
        raise NotImplementedError

    def finish(self) -> None:
        """The run ended (also on error): release what `start` took."""


class CachedDrafter(Drafter):
    """A drafter over its own paged KV cache (`cache`, made by `bind`): per run it sizes its attention and tracks
    how many of each slot's tokens the cache holds (`_cached`), so `propose` catches up on the rest."""

    @property
    def geometry(self) -> ModelGeometry:
        """The drafting model's geometry (heads, layers, positions)."""
        raise NotImplementedError

    def start(self, batch: Batch, max_rows: int) -> None:
        s = batch.num_slots
        self.cache.admit(s, batch.tokens.shape[1] - 1)
        self._attn = batch_attention(self.cache, self.geometry, s * max_rows, s + 1)
        self._cached = torch.zeros(s, dtype=torch.int64)

    def admit(self, slots: Tensor) -> None:
        self._cached[slots] = 0

    def finish(self) -> None:
        self.cache.release()


def model_cache(geometry: ModelGeometry, pages: int, page_size: int, device: torch.device,
                dtype: torch.dtype = torch.float32) -> PagedKVCache:
    """A paged KV cache shaped for a model's layers and KV heads."""
    return PagedKVCache(num_layers=geometry.num_layers, num_heads=geometry.num_kv_heads, head_dim=geometry.head_dim,
                        num_pages=pages, page_size=page_size, device=device, dtype=dtype)


def catch_up_layout(batch: Batch, slots: Tensor, cached: Tensor, device: torch.device
                    ) -> tuple[RaggedVerifyLayout, Tensor, Tensor, Tensor]:
    """The ragged forward over each request's tokens not yet in a drafter's KV cache (`cached` [S] host:
    positions below it are cached), root included: (layout, prefix [B] host, row positions [rows] and row
    slots [rows] device)."""
    lens = batch.lens[slots]
    rows = lens - cached[slots]
    prefix = lens - rows
    # built from the host lengths and moved: the attention's plan reads the host copy
    layout = RaggedVerifyLayout._from_lens(rows.to(torch.int32), (), None, None, total_rows=int(rows.sum()),
                                           host=True).to(device)
    real = layout.total_rows
    pos = layout.positions(boundary.to_device(prefix, device))[:real]
    return layout, prefix, pos, boundary.to_device(slots, device)[layout.row_slot[:real].long()]
