"""Drafters: what proposes the k tokens a step verifies (`Drafter`), and the block draft we ship (`BlockDrafter`).

A drafter proposes exactly k tokens per request with, per position, either a confidence logit
(`source="head"`: a trained head, or the drafter's own raw belief) or the features the online estimator reads
(`source="features"`, [B, k, 3]), whichever the policy asks for; under sampling also the distributions q the
tokens were drawn from (one-hot for a deterministic proposer), so rejection sampling stays lossless. It
catches up on tokens committed without it (plain steps, refills) by itself, from the batch's lengths.

A drafter given to `SpecDecoder` is a description: the decoder checks it against its target
(`check_target`: vocabulary, tokenizer, geometry) and `bind`s a copy of it to itself (its own KV cache, on
the decoder's device), once per decoder and once per `fork`. The live engine, the lockstep demo and the trace
replay drive drafters through this interface only. The other drafters: `dspark.engine.ngram.NgramDrafter`
(prompt lookup) and `dspark.engine.lm_drafter.CausalLMDrafter` (a small causal LM); docs/drafters.md.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from dspark.calibration.online import draft_features
from dspark.engine.batch import Batch
from dspark.engine.kv_cache import PagedKVCache
from dspark.engine.sampling import Sampling
from dspark.engine.step_attention import batch_attention
from dspark.models.draft import DraftModel
from dspark.models.geometry import ModelGeometry
from dspark.models.paged_attend import PagedAttend
from dspark.verify.layout import RaggedVerifyLayout

if TYPE_CHECKING:
    from dspark.engine.target import LiveTarget
    from dspark.models.transformers_lm import TransformersCausalLM

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
    layout = RaggedVerifyLayout.from_checked(rows.to(torch.int32).to(device), (), None, None,
                                             total_rows=int(rows.sum()))
    real = layout.total_rows
    pos = layout.positions(prefix.to(device))[:real]
    return layout, prefix, pos, slots.to(device)[layout.row_slot[:real].long()]


class BlockDrafter(Drafter):
    """dspark's block draft (`DraftModel`): one ragged forward over each request's uncached tokens reading the
    target's hidden states one position back (the bound decoder's `LiveTarget.hidden`), then the chain
    proposes all k at once."""

    def __init__(self, draft: DraftModel) -> None:
        if not isinstance(draft, DraftModel):
            raise TypeError(f"draft must be a dspark.models.DraftModel, got {type(draft).__name__}")
        self.draft = draft
        self.max_drafts, self.max_seq_len = draft.gamma, draft.geometry.max_seq_len
        self._cached = torch.zeros(0, dtype=torch.int64)  # host [S]: positions < this hold draft KV

    def check_target(self, target: TransformersCausalLM, tokenizer: Any = None) -> None:
        d, t = self.draft.geometry, target.geometry
        if d.hidden_size != t.hidden_size or self.draft.cfg.vocab_size != t.vocab_size:
            raise ValueError(f"the draft reads hidden size {d.hidden_size} / vocab {self.draft.cfg.vocab_size} "
                             f"but the target has {t.hidden_size} / {t.vocab_size}: load the draft trained for "
                             f"this target")

    def bind(self, states: LiveTarget, *, pages: int, page_size: int, device: torch.device) -> BlockDrafter:
        bound = copy.copy(self)
        bound.draft = self.draft.to(device).eval()
        dtype = next(bound.draft.parameters()).dtype
        bound.cache, bound.states, bound.device = model_cache(self.draft.geometry, pages, page_size, device,
                                                              dtype), states, device
        return bound

    def start(self, batch: Batch, max_rows: int) -> None:
        s = batch.num_slots
        self.cache.admit(s, batch.tokens.shape[1] - 1)
        self._attn = batch_attention(self.cache, self.draft.geometry, s * max_rows, s + 1)
        self._cached = torch.zeros(s, dtype=torch.int64)

    def admit(self, slots: Tensor) -> None:
        self._cached[slots] = 0

    def finish(self) -> None:
        self.cache.release()

    def propose(self, batch: Batch, slots: Tensor, k: int, source: Source, sampling: Sampling) -> Drafts:
        layout, prefix, pos, slot = catch_up_layout(batch, slots, self._cached, self.device)
        ids = batch.tokens[slot, pos]
        hidden = self.states.hidden
        feats = hidden[slot, (pos - 1).clamp(min=0)].to(self.cache.k.dtype) * (pos > 0)[:, None]  # h_{t-1}; 0 at 0
        attend = PagedAttend(self._attn, self.cache.k, self.cache.v, layout, prefix,
                             self.cache.block_table[slots.to(self.device)])
        h = self.draft(ids, attend.positions, feats, attend)
        self._cached[slots] = batch.lens[slots]
        hk, reduced = self.draft.chain(h.index_select(0, layout.qo_indptr[1:].long() - 1), k)
        logits = self.draft.scatter_logits(reduced)  # the chain's own draft-vocabulary logits, not recomputed
        probs = sampling.probs(logits) if sampling.enabled else None
        tokens = sampling.draw(probs).squeeze(-1) if sampling.enabled else logits.argmax(-1)
        if source == "features":  # the estimator reads the draft-vocabulary logits (1/12 of V), warped like q
            return Drafts(tokens, probs, features=draft_features(sampling.warp(reduced)), logits=logits,
                          catch_up=layout.total_rows - slots.numel())
        conf = self.draft.confidence_logits(hk, batch.roots(slots), tokens, reduced)
        return Drafts(tokens, probs, confidence_logits=conf, logits=logits, catch_up=layout.total_rows - slots.numel())
