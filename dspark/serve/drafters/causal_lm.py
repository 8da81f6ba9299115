"""CausalLMDrafter: a small transformers causal LM sharing the target's tokenizer drafts k tokens
autoregressively, over its own paged KV cache, through the same attention integration as the target
(`TransformersCausalLM` + `PagedAttend`: transformers' model code, dspark's attention).

Per `propose`: one ragged forward over each request's tokens not yet in the drafter's cache (the whole prompt
after an admission, the tokens committed since its last proposal otherwise, root included); its last row's
logits give draft 0. Then k - 1 one-row forwards, each feeding the previous draft at the next position. The
drafts' K/V land past the committed length and are overwritten by the next catch-up, which starts at the
committed length of the last proposal (positions beyond a request's committed length are never read), so
plain steps, refills and rejected drafts need nothing else. Greedy drafts are the argmax; under sampling they
are drawn from the warped q (the run's temperature, top-k and top-p, as the target's p). The estimator's
features are `draft_features` of the warped logits, and the confidence logit (source "head") is its first
feature, the log-odds of the draft's own top-1 probability.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dspark.calibration.online import draft_features
from dspark.models.geometry import ModelGeometry
from dspark.models.paged_attend import PagedAttend
from dspark.models.transformers_lm import PreTrainedModel, TransformersCausalLM
from dspark.serve.drafters.base import CachedDrafter, Drafts, Source, catch_up_layout, model_cache
from dspark.serve.sampling import Sampling
from dspark.serve.scheduler import Batch
from dspark.verify import boundary
from dspark.verify.layout import RaggedVerifyLayout

if TYPE_CHECKING:
    from dspark.serve.runner import LiveTarget


def check_same_tokenizer(target_tokenizer: Any, draft_tokenizer: Any) -> None:
    """ValueError naming the first difference between two tokenizers' vocabularies (token -> id) or special
    token ids; either one None: nothing to compare."""
    if target_tokenizer is None or draft_tokenizer is None or target_tokenizer is draft_tokenizer:
        return
    want, got = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if len(want) != len(got):
        raise ValueError(f"the drafter's tokenizer has {len(got)} tokens but the target's {len(want)}: a drafter "
                         f"must share the target's tokenizer")
    for token, i in sorted(want.items(), key=lambda item: item[1]):
        if got.get(token) != i:
            raise ValueError(f"the drafter's tokenizer differs from the target's: {token!r} is id {i} for the "
                             f"target but {got.get(token)} for the drafter")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        a, b = getattr(target_tokenizer, name, None), getattr(draft_tokenizer, name, None)
        if a != b:
            raise ValueError(f"the drafter's tokenizer differs from the target's: {name} is {a} for the target "
                             f"but {b} for the drafter")


class CausalLMDrafter(CachedDrafter):
    """Draft with a small causal LM of the target's family (module docstring).

    model: a `TransformersCausalLM`, or a transformers `PreTrainedModel` (wrapped: its attention becomes
    dspark's; `own_attention()` gives it back). tokenizer: the model's tokenizer, compared with the target's
    when the decoder knows that one (`SpecDecoder(..., tokenizer=...)`, `dspark.generate`)."""

    def __init__(self, model: TransformersCausalLM | PreTrainedModel, tokenizer: Any = None) -> None:
        if not isinstance(model, (TransformersCausalLM, PreTrainedModel)):
            raise TypeError(f"model must be a dspark.models.TransformersCausalLM or a transformers PreTrainedModel, "
                            f"got {type(model).__name__}")
        self.model = model if isinstance(model, TransformersCausalLM) else TransformersCausalLM(model)
        self.tokenizer = tokenizer
        self.max_seq_len = self.model.geometry.max_seq_len
        self._cached = torch.zeros(0, dtype=torch.int64)  # host [S]: positions < this hold the drafter's KV

    def check_target(self, target: TransformersCausalLM, tokenizer: Any = None) -> None:
        dv, tv = self.model.geometry.vocab_size, target.geometry.vocab_size
        if dv != tv:
            raise ValueError(f"the drafter's vocabulary has {dv} tokens but the target's {tv}: a causal-LM drafter "
                             f"must share the target's tokenizer and vocabulary")
        check_same_tokenizer(tokenizer, self.tokenizer)

    def bind(self, states: LiveTarget, *, pages: int, page_size: int, device: torch.device) -> CausalLMDrafter:
        bound = copy.copy(self)
        bound.model, bound.device = self.model.to(device).eval(), device
        bound.cache = model_cache(self.model.geometry, pages, page_size, device, self.model.hf_model.dtype)
        return bound

    @property
    def geometry(self) -> ModelGeometry:
        return self.model.geometry

    def _last_logits(self, ids: Tensor, layout: RaggedVerifyLayout, prefix: Tensor, table: Tensor) -> Tensor:
        """[B, V] logits of each request's last row of one forward over `layout`'s packed rows `ids`."""
        attend = PagedAttend(self._attn, self.cache.k, self.cache.v, layout, prefix, table)
        hidden = self.model(ids, attend.positions, attend)
        return self.model.logits(hidden.index_select(0, layout.qo_indptr[1:].long() - 1))

    def propose(self, batch: Batch, slots: Tensor, k: int, source: Source, sampling: Sampling) -> Drafts:
        layout, prefix, pos, slot = catch_up_layout(batch, slots, self._cached, self.device)
        table = self.cache.block_table[boundary.to_device(slots, self.device)]
        lens = batch.lens[slots]
        self._cached[slots] = lens
        logits = [self._last_logits(batch.tokens[slot, pos], layout, prefix, table)]
        one_row = RaggedVerifyLayout._from_lens(torch.ones(slots.numel(), dtype=torch.int32), (), None, None,
                                                total_rows=slots.numel(), host=True).to(self.device)
        tokens, warped, probs = [], [], []
        for i in range(k):
            warped.append(sampling.warp(logits[-1]))
            if sampling.enabled:
                probs.append(torch.softmax(warped[-1], -1))
                tokens.append(sampling.draw(probs[-1]).squeeze(-1))
            else:
                tokens.append(logits[-1].argmax(-1))
            if i + 1 < k:  # draft i at position L + i predicts draft i + 1
                logits.append(self._last_logits(tokens[-1], one_row, lens + i, table))
        features = draft_features(torch.stack(warped, 1))
        return Drafts(torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None,
                      confidence_logits=features[..., 0], features=features, logits=torch.stack(logits, 1),
                      catch_up=layout.total_rows - slots.numel())
