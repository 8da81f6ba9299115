"""How a run draws tokens: greedy, or sampling at a temperature from one seeded generator."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    """enabled False: greedy (argmax). Else tokens are drawn from softmax(logits / temperature) with `generator`."""

    enabled: bool
    temperature: float
    generator: torch.Generator

    def probs(self, logits: Tensor) -> Tensor:
        """[..., V] logits -> [..., V] float probabilities of the warped distribution."""
        return torch.softmax(logits / self.temperature, -1)

    def tokens(self, logits: Tensor) -> Tensor:
        """[..., V] logits -> [..., 1] int64 tokens: the argmax, or one draw per row."""
        return self.draw(self.probs(logits)) if self.enabled else logits.argmax(-1, keepdim=True)

    def draw(self, probs: Tensor) -> Tensor:
        """[..., V] probabilities -> [..., 1] int64: one draw per row from `generator`."""
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=self.generator).reshape(probs.shape[:-1] + (1,))
