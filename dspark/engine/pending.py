"""TEMPORARY minimal stand-ins for dspark pieces still being built on other branches.

Each name here is deleted as soon as its real module lands on main (dspark.accept);
the engine imports them only through this module so the swap is one line.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AcceptResult:
    correct_len: Tensor
    commit_lens: Tensor
    bonus: Tensor
    tokens: Tensor


def _finish(drafts: Tensor, correct: Tensor, verify_lens: Tensor, bonus_at) -> AcceptResult:
    capped = torch.minimum(correct, verify_lens.long() - 1)
    bonus = bonus_at(capped)
    w = drafts.shape[1] + 1
    cols = torch.arange(w, device=drafts.device)[None, :]
    padded = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], 1)
    tokens = torch.where(cols < capped[:, None], padded, torch.where(cols == capped[:, None], bonus[:, None], 0))
    return AcceptResult(correct, capped + 1, bonus, tokens)


def accept_greedy(drafts: Tensor, target_logits: Tensor, verify_lens: Tensor) -> AcceptResult:
    """Strided [B, W, V] target logits; leading matches capped to verify_len - 1."""
    am = target_logits.argmax(-1)
    k = drafts.shape[1]
    correct = (drafts == am[:, :k]).long().cumprod(1).sum(1)
    return _finish(drafts, correct, verify_lens, lambda c: am.gather(1, c[:, None]).squeeze(1))


def accept_sampling(drafts: Tensor, draft_probs: Tensor, target_probs: Tensor, verify_lens: Tensor,
                    generator: torch.Generator | None = None) -> AcceptResult:
    """Rejection sampling over strided [B, W, V] target probs, capped to verify_len - 1."""
    b, k = drafts.shape
    p = target_probs[:, :k].gather(2, drafts[:, :, None]).squeeze(2)
    q = draft_probs.gather(2, drafts[:, :, None]).squeeze(2)
    u = torch.rand(b, k, generator=generator, device=drafts.device)
    ok = u * q < p
    correct = ok.long().cumprod(1).sum(1)
    capped = torch.minimum(correct, verify_lens.long() - 1)
    rows = torch.arange(b, device=drafts.device)
    pt = target_probs[rows, capped]
    qt = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], 1)[rows, capped]
    rejected = (capped == correct) & (correct < k) & (capped < verify_lens.long() - 1)
    resid = torch.where(rejected[:, None], (pt - qt).clamp_min(0), pt)
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, pt)
    bonus = torch.multinomial(resid, 1, generator=generator).squeeze(1)
    return _finish(drafts, correct, verify_lens, lambda c: bonus)
