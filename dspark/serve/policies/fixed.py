"""`FixedK(k)`: draft k tokens, verify all of them (k = 0 is plain target-only decoding)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from dspark.serve.policies.base import Policy, PolicyPlan
from dspark.verify.accept import AcceptResult


class FixedK(Policy):
    """Draft k tokens and verify all k (+ the root) for every request."""

    observe_deferrable = True  # it observes nothing

    def __init__(self, k: int):
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"fixed-k needs an int k >= 0, got {k!r}")
        self.num_drafts = k
        self.name = f"fixed-{k}"

    def plan(self, confidence_logits: Tensor, slots: Tensor, generations: Tensor,
             prepass: Callable[[], AcceptResult] | None = None) -> PolicyPlan:
        b = confidence_logits.shape[0]
        lens = torch.full((b,), self.num_drafts + 1, dtype=torch.int32, device=confidence_logits.device)
        return PolicyPlan(lens)
