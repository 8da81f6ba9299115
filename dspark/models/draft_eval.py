"""The draft's block at every serving start of labelled greedy streams: what acceptance and calibration reports read.

Under greedy acceptance the context at committed length L is the stream's first L tokens whatever was accepted
before, so one dense draft pass over a stream gives the block the decode loop would propose at every start
(`dspark.lab.calibrate.block_outcomes` does the same for the STS recorder). Per start and draft position this
module returns the confidence logit, the draft distribution's features (what the online estimator reads), the
greedy accepted-draft count and, given the target's output rows, the soft accept proxy 1 - TV(q, p) of the
seed's section VII.A (q the draft's distribution, p the target's at the same position; on the accepted path
both see the same context, elsewhere the proxy is not an acceptance of anything and is reported only there).
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.calibration.confidence import previous_tokens
from dspark.calibration.online import draft_features
from dspark.models.draft import DraftModel
from dspark.models.stream_store import Streams
from dspark.models.streams import features
from dspark.util.validate import check_int


@torch.no_grad()
def block_rows(draft: DraftModel, s: Streams, gamma: int, starts: int, *, lm_head: Tensor | None = None,
               chunk: int = 8) -> dict[str, Tensor]:
    """The draft's block at starts L = P + i, i < `starts`, of every stream of `s`.

    Args:
        draft: the draft.
        s: greedy streams, tokens [N, >= P + starts + gamma - 1].
        gamma: drafts per block (<= draft.gamma).
        starts: starts per stream.
        lm_head: the target's output embedding [V, d]; given, the soft proxy is computed.
        chunk: streams per draft pass.
    Returns:
        {"conf": [N, n, g] confidence logits, "features": [N, n, g, 3] draft features, "accepted": [N, n]
        int64 greedy accepted drafts, "soft": [N, n, g] 1 - TV (only with lm_head)}, on the draft's device.
    """
    check_int("gamma", gamma, 1)
    check_int("starts", starts, 1)
    p, g = s.prompt_len, gamma
    if g > draft.gamma:
        raise ValueError(f"gamma={g} exceeds the draft's block of {draft.gamma}")
    if s.tokens.shape[1] < p + starts + g - 1:
        raise ValueError(f"streams of {s.tokens.shape[1]} tokens are too short for prompt {p} + starts {starts} + "
                         f"gamma {g} - 1")
    out: dict[str, list[Tensor]] = {"conf": [], "features": [], "accepted": [], "soft": []}
    vocab = draft.vocab_ids
    for lo in range(0, s.tokens.shape[0], chunk):
        tok, hid = (x[lo: lo + chunk].to(vocab.device) for x in (s.tokens, s.hidden))
        hid = hid.float()
        b = tok.shape[0]
        roots = draft.forward_dense(tok[:, : p + starts - 1], features(hid[:, : p + starts - 2]))[:, p - 1:]
        hk, reduced = draft.chain(roots, g)                                      # [b, n, g, d], [b, n, g, Vd]
        drafts = vocab[reduced.argmax(-1)]
        prev = previous_tokens(tok[:, p - 1: p + starts - 1].flatten(), drafts.flatten(0, 1))
        conf = draft.confidence(draft.head_inputs(hk, reduced).flatten(0, 1), prev if draft.cfg.markov_rank else None)
        truth = tok[:, p: p + starts + g - 1].unfold(1, g, 1)                   # [b, n, g]: stream[L + j]
        out["conf"].append(conf.unflatten(0, (b, starts)))
        out["features"].append(draft_features(reduced.flatten(0, 1)).unflatten(0, (b, starts)))
        out["accepted"].append(torch.cumprod((drafts == truth).long(), -1).sum(-1))
        if lm_head is not None:  # p at position L + j - 1 over the draft vocabulary (full-vocabulary softmax)
            pos = hid[:, p - 1: p + starts + g - 2]
            target = torch.softmax(pos @ lm_head.t().float(), -1)[..., vocab]   # [b, n + g - 1, Vd]
            windows = target.unfold(1, g, 1).movedim(-1, 2)                      # [b, n, g, Vd]
            out["soft"].append(torch.minimum(windows, torch.softmax(reduced.float(), -1)).sum(-1).clamp(0, 1))
    return {k: torch.cat(v) for k, v in out.items() if v}
