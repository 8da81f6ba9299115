"""`BlockDrafter`: dspark's block draft over its own paged KV cache, reading the target's hidden states."""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dspark.calibration.online import draft_features
from dspark.models.draft import DraftModel
from dspark.models.geometry import ModelGeometry
from dspark.models.paged_attend import PagedAttend
from dspark.serve.drafters.base import CachedDrafter, Drafts, Source, catch_up_layout, model_cache
from dspark.serve.sampling import Sampling
from dspark.serve.scheduler import Batch
from dspark.verify import boundary

if TYPE_CHECKING:
    from dspark.models.transformers_lm import TransformersCausalLM
    from dspark.serve.runner import LiveTarget


class BlockDrafter(CachedDrafter):
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

    @property
    def geometry(self) -> ModelGeometry:
        return self.draft.geometry

    def propose(self, batch: Batch, slots: Tensor, k: int, source: Source, sampling: Sampling) -> Drafts:
        layout, prefix, pos, slot = catch_up_layout(batch, slots, self._cached, self.device)
        ids = batch.tokens[slot, pos]
        hidden = self.states.hidden
        feats = hidden[slot, (pos - 1).clamp(min=0)].to(self.cache.k.dtype) * (pos > 0)[:, None]  # h_{t-1}; 0 at 0
        attend = PagedAttend(self._attn, self.cache.k, self.cache.v, layout, prefix,
                             self.cache.block_table[boundary.to_device(slots, self.device)])
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
