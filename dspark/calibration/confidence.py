"""Confidence head, its soft training target `1 - TV(q, p)`, and the position-decayed BCE loss.

Indexing (DESIGN.md 4.3/4.4: a draft's rank never depends on its own token's value):
the logit for draft k is computed from `hidden[:, k]`, the draft model's hidden state that *produced* the
distribution draft k is sampled from, and, with a Markov embedding, from the token *before* draft k:
the anchor (last committed token) for k = 0 and draft k-1 for k >= 1 (`previous_tokens`). Draft k's own
token never enters its confidence.

Features: the head's input may end with `num_features` scalar features of that distribution (the draft's
top-1 log-odds, top-2 margin and entropy, `dspark.calibration.online.draft_features`): functions of the state
that one Linear over it cannot form, and the strongest single predictors of acceptance. With `positions` > 0
each draft position also gets its own bias and its own weights on those features (the online estimator's
per-position model), beside the Linear shared by all positions.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark.util.validate import check_int, check_tensor


def previous_tokens(anchor_tokens: Tensor, draft_tokens: Tensor) -> Tensor:
    """Token preceding each draft position: [anchor, d_0, ..., d_{gamma-2}] -> [B, gamma]."""
    check_tensor("anchor_tokens", anchor_tokens)
    check_tensor("draft_tokens", draft_tokens)
    if anchor_tokens.dim() != 1 or draft_tokens.dim() != 2 or draft_tokens.shape[0] != anchor_tokens.shape[0]:
        raise ValueError(f"anchor_tokens must be [B] and draft_tokens [B, gamma], got "
                         f"{tuple(anchor_tokens.shape)} and {tuple(draft_tokens.shape)}")
    out = torch.cat([anchor_tokens.unsqueeze(1).to(draft_tokens.dtype), draft_tokens[:, :-1]], dim=1)
    return out[:, : draft_tokens.shape[1]]  # gamma = 0: [B, 0]


class ConfidenceHead(nn.Module):
    """One Linear from the draft hidden state (+ optional previous-token embedding) to one logit per draft, plus
    per-position bias and weights on the input's last `num_features` entries (the distribution's features).

    `markov_rank` is the width of the previous-token embedding (0 disables it; then `vocab_size` is unused);
    `positions` the number of draft positions with their own terms (0: none; then `num_features` is unused).
    """

    def __init__(self, hidden_size: int, markov_rank: int = 0, vocab_size: int | None = None, *,
                 num_features: int = 0, positions: int = 0):
        super().__init__()
        for name, v, lo in (("hidden_size", hidden_size, 1), ("markov_rank", markov_rank, 0),
                            ("num_features", num_features, 0), ("positions", positions, 0)):
            check_int(name, v, lo)
        if markov_rank > 0 and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
            raise ValueError(f"markov_rank={markov_rank} needs vocab_size as an int >= 1, got {vocab_size!r}")
        if num_features > hidden_size:
            raise ValueError(f"num_features={num_features} exceeds hidden_size={hidden_size} (features are the "
                             f"input's last entries)")
        self.hidden_size, self.markov_rank = hidden_size, markov_rank
        self.num_features, self.positions = (num_features, positions) if positions else (0, 0)
        self.embed = nn.Embedding(vocab_size, markov_rank) if markov_rank > 0 else None
        self.proj = nn.Linear(hidden_size + markov_rank, 1)
        self.position_bias = nn.Parameter(torch.zeros(positions)) if positions else None
        self.position_weight = nn.Parameter(torch.zeros(positions, self.num_features)) if positions else None

    def forward(self, hidden: Tensor, prev_tokens: Tensor | None = None) -> Tensor:
        """Confidence logits [B, gamma] from hidden [B, gamma, H] and prev_tokens [B, gamma] (Markov only);
        with per-position terms gamma <= `positions`, position k using row k of them."""
        if check_tensor("hidden", hidden).dim() != 3 or hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden must be [B, gamma, {self.hidden_size}], got {tuple(hidden.shape)}")
        g = hidden.shape[1]
        if self.positions and g > self.positions:
            raise ValueError(f"hidden has gamma={g} positions, the head has per-position terms for {self.positions}")
        x = hidden
        if self.embed is not None:
            if prev_tokens is None or tuple(check_tensor("prev_tokens", prev_tokens).shape) != tuple(hidden.shape[:2]):
                got = None if prev_tokens is None else tuple(prev_tokens.shape)
                raise ValueError(f"prev_tokens must be [B, gamma] = {tuple(hidden.shape[:2])} "
                                 f"(see previous_tokens), got {got}")
            x = torch.cat([hidden, self.embed(prev_tokens).to(hidden.dtype)], dim=-1)
        elif prev_tokens is not None:
            raise ValueError("prev_tokens given but the head has markov_rank=0")
        z = self.proj(x).squeeze(-1)
        if self.positions:
            f = hidden[..., hidden.shape[-1] - self.num_features:]
            z = z + self.position_bias[:g].to(z.dtype) + (f * self.position_weight[:g].to(f.dtype)).sum(-1)
        return z


def soft_accept_target(draft_logits: Tensor, target_logits: Tensor) -> Tensor:
    """`1 - TV(softmax q, softmax p)` over the last dim, float32: the mean rejection-sampling accept rate."""
    if (check_tensor("draft_logits", draft_logits).shape != check_tensor("target_logits", target_logits).shape
            or draft_logits.dim() < 1):
        raise ValueError(f"draft_logits and target_logits must have equal shape [..., V], got "
                         f"{tuple(draft_logits.shape)} and {tuple(target_logits.shape)}")
    q = torch.softmax(draft_logits.to(torch.float32), dim=-1)
    p = torch.softmax(target_logits.to(torch.float32), dim=-1)
    # Rounding can push 1 - TV a few ulps outside [0, 1]; the BCE target must stay a probability.
    return (1.0 - 0.5 * (q - p).abs().sum(dim=-1)).clamp(0.0, 1.0)


def check_prefix_mask(mask: Tensor, name: str = "mask") -> Tensor:
    """Validate a [B, gamma] prefix mask (ones then zeros per row); returns it as bool."""
    if check_tensor(name, mask).dim() != 2:
        raise ValueError(f"{name} must be [B, gamma], got shape {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            r, k = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"{name} must hold only 0/1, got {name}[{r}, {k}] = {mask[r, k].item()}")
        mask = mask != 0
    rises = ~mask[:, :-1] & mask[:, 1:]
    if bool(rises.any()):
        r = int(rises.nonzero()[0][0])
        raise ValueError(f"{name} must be a contiguous prefix per row (ones then zeros), "
                         f"row {r} is {mask[r].int().tolist()}")
    return mask


def confidence_loss(logits: Tensor, target: Tensor, mask: Tensor, decay: float) -> Tensor:
    """BCE-with-logits against the soft target, weighted by exp(-k / decay) over the valid prefix `mask`.

    Returns the weighted mean (0 when no position is valid). `decay = math.inf` weights all positions equally.
    """
    for name, t in (("logits", logits), ("target", target), ("mask", mask)):
        check_tensor(name, t)
    if logits.shape != target.shape or logits.shape != mask.shape or logits.dim() != 2:
        raise ValueError(f"logits, target and mask must all be [B, gamma], got {tuple(logits.shape)}, "
                         f"{tuple(target.shape)} and {tuple(mask.shape)}")
    if not isinstance(decay, (int, float)) or isinstance(decay, bool) or math.isnan(decay) or decay <= 0:
        raise ValueError(f"decay must be a number > 0 (math.inf for no decay), got {decay!r}")
    valid = check_prefix_mask(mask)
    pos = torch.arange(logits.shape[1], device=logits.device, dtype=torch.float32)
    w = torch.exp(-pos / float(decay)).unsqueeze(0) * valid.to(torch.float32)
    # Positions outside the prefix may hold NaN targets (censored); they must not poison the sum.
    t = torch.where(valid, target.to(torch.float32), torch.zeros_like(w))
    bce = F.binary_cross_entropy_with_logits(logits.to(torch.float32), t, reduction="none")
    return torch.where(valid, w * bce, torch.zeros_like(w)).sum() / w.sum().clamp_min(1.0e-12)
