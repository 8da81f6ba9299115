"""Drafters: what proposes the k tokens a step verifies (`Drafter`), and the block draft we ship (`BlockDrafter`).

A drafter proposes up to k tokens per request with, per position, either a confidence logit from its own
head (`source="head"`) or the features the online estimator reads (`source="features"`), whichever the
policy asks for. It catches up on tokens committed without it (plain steps, refills) by itself, from the
batch's lengths. The live engine, the lockstep demo and the trace replay drive drafters through this
interface only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from dspark.calibration.online import draft_features
from dspark.engine.batch import Batch
from dspark.engine.kv_cache import PagedKVCache
from dspark.engine.sampling import Sampling
from dspark.engine.step_attention import batch_attention
from dspark.models.draft import DraftModel
from dspark.models.paged_attend import PagedAttend
from dspark.verify.layout import RaggedVerifyLayout

Source = Literal["head", "features"]


@dataclass
class Drafts:
    """One step's proposals for B requests (device tensors)."""

    tokens: Tensor                          # [B, k] int64 proposed tokens
    probs: Tensor | None = None             # [B, k, V] the distributions they were drawn from (sampling)
    confidence_logits: Tensor | None = None  # [B, k] the drafter's own head (source "head")
    features: Tensor | None = None          # [B, k, F] the online estimator's inputs (source "features")
    logits: Tensor | None = None            # [B, k, V] token logits (telemetry: the top-2 margin baseline)


class Drafter:
    """The plug-in point for proposals. `max_drafts`: the most tokens one `propose` can return."""

    max_drafts: int = 0

    def start(self, batch: Batch, max_rows: int) -> None:
        """A run begins on `batch`; no request catches up more than `max_rows` tokens in one `propose`."""

    def admit(self, slots: Tensor) -> None:
        """New requests took `slots` (host ids); their prompts are in the batch."""

    def propose(self, batch: Batch, slots: Tensor, k: int, source: Source, sampling: Sampling) -> Drafts:
        """k >= 1 proposals for the requests in `slots` (host ids, ascending)."""
        raise NotImplementedError

    def finish(self) -> None:
        """The run ended (also on error): release what `start` took."""


class BlockDrafter(Drafter):
    """dspark's block draft (`DraftModel`): one ragged forward over each request's uncached tokens reading the
    target's hidden states one position back (`hidden`: a `TargetStates` view), then the chain proposes
    all k at once."""

    def __init__(self, draft: DraftModel, cache: PagedKVCache, states: "TargetStates") -> None:
        self.draft, self.cache, self.states = draft, cache, states
        self.max_drafts = draft.gamma
        self.device = cache.k.device
        self._cached = torch.zeros(0, dtype=torch.int64)  # host [S]: positions < this hold draft KV

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
        lens, dev = batch.lens[slots], self.device
        rows = lens - self._cached[slots]
        prefix = lens - rows
        layout = RaggedVerifyLayout.from_verify_lens(rows.to(torch.int32).to(dev))
        real = layout.total_rows
        pos = layout.positions(prefix.to(dev))[:real]
        dev_slots = slots.to(dev)
        slot = dev_slots[layout.row_slot[:real].long()]
        ids = batch.tokens[slot, pos]
        hidden = self.states.hidden
        feats = hidden[slot, (pos - 1).clamp(min=0)] * (pos > 0)[:, None]  # h_{t-1}; zeros at position 0
        attend = PagedAttend(self._attn, self.cache.k, self.cache.v, layout, prefix, self.cache.block_table[dev_slots])
        h = self.draft(ids, attend.positions, feats, attend)
        self._cached[slots] = lens
        hk, reduced = self.draft.chain(h.index_select(0, layout.qo_indptr[1:].long() - 1), k)
        logits = self.draft.scatter_logits(reduced)  # the chain's own draft-vocabulary logits, not recomputed
        probs = sampling.probs(logits) if sampling.enabled else None
        tokens = sampling.draw(probs).squeeze(-1) if sampling.enabled else logits.argmax(-1)
        if source == "features":  # the estimator reads the draft-vocabulary logits (1/12 of V), warped like q
            x = reduced / sampling.temperature if sampling.enabled else reduced
            return Drafts(tokens, probs, features=draft_features(x), logits=logits)
        conf = self.draft.confidence_logits(hk, batch.roots(slots), tokens)
        return Drafts(tokens, probs, confidence_logits=conf, logits=logits)
