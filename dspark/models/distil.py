"""Distilling the block draft on labelled streams of several prompt kinds (`train_draft`'s stage 2).

Every row t >= 1 of a stream is a training row, prompt rows included: the draft reads (h_{t-1}, token t) and
chain step j is trained toward the target's top-1 at position t + j (`Streams.argmax`), with the true token
t + j as step j's input. On the continuation that is exactly the serving event (the argmax is the next
token); on the prompt it is teacher-forced real text, which the target pays for once per token instead of
once per generated token. The loss per (row, step) mixes hard cross-entropy on the top-1 (mapped into the
draft vocabulary; a top-1 outside it is no label), cross-entropy on the target's softmax over the draft
vocabulary (`soft_weight`) and, EAGLE-style, the relative squared error between the step's state and the
target's final-normed hidden state at t + j (`feature_weight`): the draft's logits are that state times the
target's own output rows, so matching the state matches the whole distribution. AdamW with warm-up and
cosine decay, bf16 autocast on the draft's device (streams stay on the host, each step's rows are copied
over); each step draws its streams from one kind, kinds in proportion to their rows.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from dspark.models.draft import DraftModel
from dspark.models.stream_store import Streams
from dspark.models.streams import features
from dspark.util.validate import check_int, check_real

Log = Callable[[str], None]


def _windows(x: Tensor, start: int, g: int, fill: float) -> Tensor:
    """[n, T, ...] -> [n, T - start, g, ...]: element t + j of x at row t (from `start`), `fill` past the end."""
    pad = torch.full((x.shape[0], g - 1, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    w = torch.cat([x, pad], 1)[:, start:].unfold(1, g, 1)
    return w.movedim(-1, 2) if x.dim() > 2 else w


def row_labels(draft: DraftModel, s: Streams) -> tuple[Tensor, Tensor]:
    """(labels [n, T - 2, g] draft-vocabulary ids, -100 where none; teacher [n, T - 2, g - 1] target ids) for
    rows t = 1..T-2 of streams `s`: step j of row t learns the target's top-1 at t + j from token t + j."""
    g = draft.gamma
    to_draft = torch.full((draft.cfg.vocab_size + 1,), -100, dtype=torch.int64)  # index -1 (past end) -> none
    to_draft[draft.vocab_ids.cpu()] = torch.arange(draft.vocab_ids.numel())
    labels = to_draft[_windows(s.argmax, 1, g, -1)]
    teacher = _windows(s.tokens, 2, g, 0)[:, :, : g - 1]
    return labels, teacher


def step_loss(draft: DraftModel, tokens: Tensor, hidden: Tensor, labels: Tensor, teacher: Tensor,
              soft_weight: float, feature_weight: float) -> tuple[Tensor, Tensor]:
    """(mean loss over the labelled (row, step) pairs, top-1 hits per step [g]) of one batch.

    tokens [b, T]; hidden [b, T - 1, d] (float); labels [b, T - 2, g]; teacher [b, T - 2, g - 1]."""
    g, t, device = draft.gamma, tokens.shape[1], tokens.device.type
    with torch.autocast(device, dtype=torch.bfloat16):
        x = draft.forward_dense(tokens, features(hidden))[:, 1: t - 1]
        hk, reduced = draft.chain(x, g, teacher)
    valid = labels >= 0
    logq = torch.log_softmax(reduced.float(), -1)
    per = -(1 - soft_weight) * logq.gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    target_h = _windows(hidden[:, 1:], 0, g, 0.0)                      # [b, T - 2, g, d]: h at t + j
    if soft_weight:
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            soft = torch.softmax((hidden[:, 1:] @ draft.out_rows.t()).float(), -1)
        per = per - soft_weight * (_windows(soft, 0, g, 0.0) * logq).sum(-1)
    if feature_weight:
        err = (hk.float() - target_h).pow(2).sum(-1) / target_h.pow(2).sum(-1).clamp_min(1e-6)
        per = per + feature_weight * err
    loss = (per * valid).sum() / valid.sum().clamp_min(1)
    hits = ((reduced.argmax(-1) == labels) & valid).sum((0, 1))
    return loss, hits.float() / valid.sum((0, 1)).clamp_min(1)


@dataclass(frozen=True)
class DistilConfig:
    """The distillation's schedule and loss, checked when built.

    steps: optimiser steps; rows: training rows per step (streams per step: rows // (T - 2) of the step's kind, at
    least 1); lr, weight_decay: AdamW (betas 0.9 / 0.95), warm-up over steps // 20, cosine decay to 0.1 lr;
    soft_weight: weight of the soft cross-entropy against the target's distribution (1 - it: hard), in [0, 1];
    feature_weight: weight of the relative state error; seed: the draw of kinds and streams.
    """

    steps: int
    rows: int
    lr: float
    weight_decay: float
    soft_weight: float
    feature_weight: float
    seed: int

    def __post_init__(self) -> None:
        check_int("steps", self.steps, 0)
        check_int("rows", self.rows, 1)
        check_int("seed", self.seed, 0)
        check_real("lr", self.lr, 0, math.inf, low_open=True, high_open=True)
        for name in ("weight_decay", "feature_weight"):
            check_real(name, getattr(self, name), 0, math.inf, high_open=True)
        check_real("soft_weight", self.soft_weight, 0, 1)


def distil(draft: DraftModel, sets: dict[str, Streams], config: DistilConfig, *, log: Log) -> None:
    """Train `draft` in place on the streams of every kind in `sets` ({kind: Streams}).

    Args:
        draft: the draft (its target's embedding and output rows are frozen buffers).
        sets: labelled streams per kind.
        config: the steps, rows per step, optimiser, loss weights and seed.
        log: progress lines (40 over the run).
    """
    steps, rows, lr, seed = config.steps, config.rows, config.lr, config.seed
    soft_weight, feature_weight = config.soft_weight, config.feature_weight
    kinds, device = sorted(sets), draft.vocab_ids.device
    data = {k: (sets[k], *row_labels(draft, sets[k])) for k in kinds}
    weight = torch.tensor([float((data[k][1] >= 0).sum()) for k in kinds])
    params = [q for q in draft.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    warm, t0, shown = max(1, steps // 20), time.perf_counter(), []
    draft.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        s, labels, teacher = data[kinds[int(torch.multinomial(weight, 1, generator=gen))]]
        b = max(1, rows // (s.tokens.shape[1] - 2))
        idx = torch.randint(0, s.tokens.shape[0], (b,), generator=gen)
        tokens, hidden, rows_labels, rows_teacher = (x[idx].to(device) for x in (s.tokens, s.hidden, labels, teacher))
        loss, hits = step_loss(draft, tokens, hidden.float(), rows_labels, rows_teacher, soft_weight, feature_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        shown.append(hits)
        if (step + 1) % max(1, steps // 40) == 0 or step + 1 == steps:
            acc, el = torch.stack(shown).mean(0), time.perf_counter() - t0
            eta = el / (step + 1) * (steps - step - 1)
            log(f"distil step {step + 1}/{steps}  loss {loss.item():.3f}  train top-1 "
                f"{' '.join(f'{a:.2f}' for a in acc.tolist())}  {el:.0f} s (eta {eta:.0f} s)")
            shown = []
    draft.eval()
