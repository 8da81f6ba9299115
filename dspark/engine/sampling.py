"""How a run draws tokens: greedy, or sampling from one seeded generator at a temperature, optionally
restricted to the top-k tokens and / or the top-p nucleus.

The warp is transformers' own, in its order (`TemperatureLogitsWarper`, `TopKLogitsWarper`,
`TopPLogitsWarper`): divide by the temperature, keep the k largest logits (ties at the k-th kept), then keep
the smallest set of largest-probability tokens whose mass exceeds top_p (at least one). The target's rows and
every drafter's proposals go through the same `probs`, so rejection sampling compares the draft's warped q
with the target's warped p and the committed tokens follow the target's warped distribution.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dspark.util.validate import check_int, check_real, check_type


@dataclass(frozen=True)
class Sampling:
    """enabled False: greedy (argmax; temperature, top_k and top_p unused). Else tokens are drawn with
    `generator` from the warped distribution: softmax of logits / temperature over the top_k largest (None:
    all) and within the top_p nucleus (None or 1: all)."""

    enabled: bool
    temperature: float
    generator: torch.Generator
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        check_type("sampling", self.enabled, bool)
        if self.enabled:  # greedy ignores it (temperature 0 is a common way to ask for greedy)
            check_real("temperature", self.temperature, 0, math.inf, low_open=True, high_open=True)
        if self.top_k is not None:
            check_int("top_k", self.top_k, 1)
        if self.top_p is not None:
            check_real("top_p", self.top_p, 0, 1, low_open=True)

    def warp(self, logits: Tensor) -> Tensor:
        """[..., V] logits -> [..., V] float logits of the warped distribution (-inf outside top-k / top-p);
        greedy: the logits unchanged."""
        if not self.enabled:
            return logits
        x = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < x.shape[-1]:
            kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, -math.inf)
        if self.top_p is not None and self.top_p < 1:
            ascending, order = torch.sort(x, dim=-1)
            drop = ascending.softmax(-1).cumsum(-1) <= 1 - self.top_p
            drop[..., -1] = False  # the most likely token always stays
            x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -math.inf)
        return x

    def probs(self, logits: Tensor) -> Tensor:
        """[..., V] logits -> [..., V] float probabilities of the warped distribution."""
        return torch.softmax(self.warp(logits), -1)

    def tokens(self, logits: Tensor) -> Tensor:
        """[..., V] logits -> [..., 1] int64 tokens: the argmax, or one draw per row."""
        return self.draw(self.probs(logits)) if self.enabled else logits.argmax(-1, keepdim=True)

    def draw(self, probs: Tensor) -> Tensor:
        """[..., V] probabilities -> [..., 1] int64: one draw per row from `generator`."""
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=self.generator).reshape(probs.shape[:-1] + (1,))
