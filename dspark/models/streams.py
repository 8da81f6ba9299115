"""The target's greedy continuations of prompts ("greedy streams") with its hidden states along the way.

Under greedy acceptance every committed token is the target's greedy token, so the serving context after a
prompt is exactly this stream whatever the verify policy does; the target's final-normed hidden states on
it are exactly the draft's features in the decode loop. The draft's training, its confidence head's fit and
the fast STS recorder (`dspark.lab.calibrate.record_sts_teacher_forced`) all read streams. Decoding uses the
transformers model's own attention and KV cache (one query row per request and step); tests check that it
commits exactly the engine's tokens.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache

from dspark.util.validate import check_int

Log = Callable[[str], None]


@torch.no_grad()
def greedy_streams(model: nn.Module, prompts: Tensor, new_tokens: int, *, batch: int = 64,
                   log: Log | None = None) -> tuple[Tensor, Tensor]:
    """Greedy continuations by a transformers causal LM in its own attention (for a wrapped target:
    `with target.own_attention() as model`): tokens [N, P + new_tokens] and the final-normed hidden states
    [N, P + new_tokens - 1, d] (float32) at every position but the last, `batch` requests at a time."""
    check_int("new_tokens", new_tokens, 1)
    check_int("batch", batch, 1)
    if not isinstance(prompts, Tensor) or prompts.dim() != 2 or prompts.dtype != torch.long or prompts.shape[1] < 1:
        raise ValueError(f"prompts must be an int64 tensor [N, P >= 1], got {getattr(prompts, 'shape', prompts)}")
    limit = model.config.max_position_embeddings
    if prompts.shape[1] + new_tokens > limit:
        raise ValueError(f"prompt {prompts.shape[1]} + new_tokens {new_tokens} exceeds the target's max_seq_len "
                         f"{limit}")
    head, base, device = model.get_output_embeddings(), model.base_model, model.device
    toks, hids = [], []
    # transformers renamed the forward's `past_key_values` to `cache` in 5.2x: name whichever this one takes
    cache_kw = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    for i, x in enumerate(prompts.to(device).split(batch)):
        cache = DynamicCache(config=model.config)
        hs, seq = [base(input_ids=x, use_cache=True, **{cache_kw: cache}).last_hidden_state], [x]
        for j in range(new_tokens):
            seq.append(head(hs[-1][:, -1]).argmax(-1, keepdim=True))
            if j + 1 < new_tokens:  # the last token needs no hidden state
                hs.append(base(input_ids=seq[-1], use_cache=True, **{cache_kw: cache}).last_hidden_state)
        toks.append(torch.cat(seq, 1))
        hids.append(torch.cat(hs, 1).float())
        if log is not None:
            log(f"greedy streams {min((i + 1) * batch, prompts.shape[0])}/{prompts.shape[0]}")
    return torch.cat(toks), torch.cat(hids)


def features(hidden: Tensor) -> Tensor:
    """Target hidden states [b, T - 1, d] at positions 0..T-2 -> the draft's features [b, T, d] for positions
    0..T-1 (row t holds h_{t-1}; zeros at row 0), as the decode loop hands them to the draft."""
    return F.pad(hidden, (0, 0, 1, 0))


def stream_labels(draft_logits: Tensor, truth: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy conditional acceptance labels from block draft logits [..., g, V] and the stream tokens
    truth [..., g] they propose: (label 1[argmax == truth], mask = drafts < k all matched), both [..., g]."""
    match = draft_logits.argmax(-1) == truth
    reached = torch.cumprod(torch.cat([torch.ones_like(match[..., :1]), match[..., :-1]], -1).to(torch.int8), -1)
    return match.to(torch.float32), reached.bool()
