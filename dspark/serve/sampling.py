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

from dspark.serve.config import SamplingParams


@dataclass(frozen=True)
class Sampling:
    """A run's draws: its `SamplingParams` and the generator seeded with their seed (on the run's device)."""

    params: SamplingParams
    generator: torch.Generator

    @classmethod
    def seeded(cls, params: SamplingParams, device: torch.device) -> Sampling:
        """The run's draws, from a generator on `device` seeded with `params.seed`."""
        return cls(params, torch.Generator(device=device).manual_seed(params.seed))

    @property
    def enabled(self) -> bool:
        """False under greedy decoding."""
        return not self.params.greedy

    def warp(self, logits: Tensor) -> Tensor:
        """[..., V] logits -> [..., V] float logits of the warped distribution (-inf outside top-k / top-p);
        greedy: the logits unchanged."""
        if not self.enabled:
            return logits
        top_k, top_p = self.params.top_k, self.params.top_p
        x = logits.float() / self.params.temperature
        if top_k is not None and top_k < x.shape[-1]:
            kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, -math.inf)
        if top_p is not None and top_p < 1:
            ascending, order = torch.sort(x, dim=-1)
            drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
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
