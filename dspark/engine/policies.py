"""Verify-budget policies: how many drafts to propose and how many rows each request verifies.

- `FixedK(k)`: draft k tokens, verify all of them (k = 0 is plain target-only decoding).
- `Adaptive(planner)`: draft gamma tokens, let dspark's VerifyPlanner pick per-request verify lengths
  from the calibrated confidence (lagged budget, live allocation, tier fill).
- `Oracle(gamma)`: draft gamma tokens, verify exactly the rows that turn out to be accepted. The
  acceptance is found by a full static verify that is run *outside* the timed step (`prepass`), so its
  time is an upper bound on what any budget policy could reach with this draft and target.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dspark.layout import RaggedVerifyLayout
from dspark.planner import VerifyPlanner


@dataclass
class PolicyPlan:
    """One step's decision: verify lengths [B] int32 (root included) and what the planner saw."""

    verify_lens: Tensor
    survival: Tensor | None = None        # [B, drafts] live calibrated survival (None without drafts)
    layout: RaggedVerifyLayout | None = None  # the planner's layout (tier-padded) when it built one
    budget: int | None = None


class FixedK:
    """Draft k tokens and verify all k (+ the root) for every request."""

    prepass = False

    def __init__(self, k: int):
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"fixed-k needs an int k >= 0, got {k!r}")
        self.num_drafts = k
        self.name = f"fixed-{k}"

    def plan(self, confidence_logits: Tensor, slots: Tensor, generations: Tensor) -> PolicyPlan:
        b = confidence_logits.shape[0]
        lens = torch.full((b,), self.num_drafts + 1, dtype=torch.int32, device=confidence_logits.device)
        return PolicyPlan(lens)


class Adaptive:
    """dspark's VerifyPlanner: budget from lagged calibrated survival and the cost model, live allocation."""

    prepass = False
    name = "adaptive"

    def __init__(self, planner: VerifyPlanner):
        self.planner = planner
        self.num_drafts = planner.cfg.gamma

    def plan(self, confidence_logits: Tensor, slots: Tensor, generations: Tensor) -> PolicyPlan:
        p = self.planner.plan(confidence_logits, slots, generations)
        return PolicyPlan(p.verify_lens, survival=p.survival, layout=p.layout, budget=p.budget)


class Oracle:
    """Verify exactly the accepted rows (known from an untimed full-verify prepass)."""

    prepass = True
    name = "oracle"

    def __init__(self, gamma: int):
        self.num_drafts = gamma
