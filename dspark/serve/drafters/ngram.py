"""NgramDrafter: prompt lookup. Each request's drafts are the tokens that followed the longest earlier
occurrence of its own suffix, found in its prompt and output; no model, no KV cache.

Per request of length L (the root, its last committed token, at L - 1), batched over the step's requests on
the device, in three passes over the committed tokens (O(B * L * (n_max + k)), no host read):
  match     the longest suffix length n in [n_min, n_max] that also ends at an earlier position j <= L - 2;
            among those ends the latest, j*, is proposed from (the most recent context);
  propose   d_i = x[j* + 1 + i] for i = 0..k-1, where x is the request's tokens extended by its own
            proposals: past the end, a match p = L - 1 - j* tokens back repeats with period p
            (d_i = d_{i - p}), so a match always yields k tokens; without a match every d_i is the root
            (nothing to copy) and the features say so;
  features  per position i, for the online estimator ([B, k, 3] float32):
            0  continuation log-odds: of the s_{i-1} earlier ends of the matched n-gram whose continuation
               agreed with d_0..d_{i-1} (s_{-1}: all of them), s_i also agreed at i;
               log((s_i + 1/2) / (s_{i-1} - s_i + 1/2)) (NO_MATCH without a match);
            1  the match length n (0 without a match);
            2  log of the match distance p (0 without a match): a nearby match is a loop being repeated.
Feature 0 is the drafter's own confidence logit (source "head"), and with the estimator's warm-up prior
(sigmoid of feature 0) an n-gram seen once with one continuation starts at 0.75.
Under sampling the proposals are deterministic, so q is one-hot at d_i: rejection sampling accepts d_i with
probability p(d_i) and otherwise draws from p without d_i, which is lossless.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dspark.serve.drafters.base import Drafter, Drafts, Source
from dspark.serve.sampling import Sampling
from dspark.serve.scheduler import Batch
from dspark.util.validate import check_int
from dspark.verify import boundary

if TYPE_CHECKING:
    from dspark.serve.runner import LiveTarget

NO_MATCH = -8.0  # feature 0 without a match: sigmoid(-8) = 3e-4, never worth verifying under the prior


class NgramDrafter(Drafter):
    """Prompt-lookup drafter: the continuation of the longest suffix match of length n_min..n_max in each
    request's own prompt + output (see the module docstring for the rule and its features).

    n_min, n_max: the shortest and longest suffix matched (1 <= n_min <= n_max)."""

    def __init__(self, n_min: int = 1, n_max: int = 4) -> None:
        check_int("n_min", n_min, 1)
        check_int("n_max", n_max, 1)
        if n_min > n_max:
            raise ValueError(f"n_min must be <= n_max, got n_min={n_min} > n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.vocab_size: int | None = None  # the bound target's: the width of the one-hot q under sampling

    def __repr__(self) -> str:
        return f"NgramDrafter(n_min={self.n_min}, n_max={self.n_max})"

    def bind(self, states: LiveTarget, *, pages: int, page_size: int, device: torch.device) -> NgramDrafter:
        bound = super().bind(states, pages=pages, page_size=page_size, device=device)
        bound.vocab_size = states.model.geometry.vocab_size  # proposals are the request's own tokens
        return bound

    def propose(self, batch: Batch, slots: Tensor, k: int, source: Source, sampling: Sampling) -> Drafts:
        dev = batch.tokens.device
        tokens, features = lookup(batch.tokens[boundary.to_device(slots, dev)],
                                  boundary.to_device(batch.lens[slots], dev), k, self.n_min, self.n_max)
        probs = None
        if sampling.enabled:
            probs = torch.nn.functional.one_hot(tokens, self.vocab_size).float()
        return Drafts(tokens, probs, confidence_logits=features[..., 0], features=features)


def lookup(tokens: Tensor, lens: Tensor, k: int, n_min: int, n_max: int) -> tuple[Tensor, Tensor]:
    """Proposals [B, k] int64 and features [B, k, 3] float32 for rows `tokens` [B, C] int64 of committed
    lengths `lens` [B] int64 (>= 1; entries at or past a row's length are ignored), as the module docstring
    defines them."""
    b, c = tokens.shape
    dev = tokens.device
    cols = torch.arange(c, device=dev)
    last = lens - 1
    # match: run[j] stays true while x[j - t] == x[L - 1 - t] for t = 0, 1, ...; length[j] counts those t
    padded = torch.cat([torch.full((b, n_max), -1, dtype=tokens.dtype, device=dev), tokens], 1)
    run = (cols[None, :] < last[:, None])  # an end j <= L - 2 (the suffix itself ends at L - 1)
    length = torch.zeros(b, c, dtype=torch.int64, device=dev)
    for t in range(n_max):
        suffix = tokens.gather(1, (last - t).clamp(min=0)[:, None])
        run = run & (padded[:, n_max - t: n_max - t + c] == suffix) & (t < lens)[:, None]
        length += run
    best = length.max(1).values
    matched = best >= n_min
    ends = length == best[:, None]
    j_star = c - 1 - ends.flip(1).to(torch.int8).argmax(1)  # the latest end of the longest match
    period = (last - j_star).clamp(min=1)
    i = torch.arange(k, device=dev)
    src = torch.where(matched[:, None], j_star[:, None] + 1 + i[None, :] % period[:, None], last[:, None])
    drafts = tokens.gather(1, src)
    # features: which earlier ends of the matched n-gram continued as the drafts (x extended by the drafts)
    ext = torch.cat([tokens, torch.zeros(b, k, dtype=tokens.dtype, device=dev)], 1)
    ext.scatter_(1, lens[:, None] + i[None, :], drafts)
    follow = ext.gather(1, (cols[:, None] + 1 + i[None, :]).flatten()[None, :].expand(b, -1)).view(b, c, k)
    agree = torch.cumprod((follow == drafts[:, None, :]).to(torch.int64), 2) * (ends & matched[:, None])[..., None]
    support = agree.sum(1).double()  # [B, k]
    before = torch.cat([ends.sum(1, keepdim=True).double(), support[:, :-1]], 1)
    log_odds = torch.log((support + 0.5) / (before - support + 0.5))
    per_request = torch.stack([best.double(), torch.log(period.double())], 1)[:, None, :].expand(b, k, 2)
    feats = torch.cat([log_odds[..., None], per_request], -1)
    none = torch.tensor([NO_MATCH, 0.0, 0.0], dtype=feats.dtype, device=dev)
    feats = torch.where(matched[:, None, None], feats, none)
    return drafts, feats.to(torch.float32)
