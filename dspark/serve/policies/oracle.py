"""`Oracle(gamma)`: draft gamma tokens, verify exactly the rows that turn out to be accepted.

The acceptance is found by a full static verify run *outside* the timed step (`prepass`), so its time is an upper
bound on what any budget policy could reach with this draft and target.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from dspark.serve.policies.base import Policy, PolicyPlan
from dspark.verify.accept import AcceptResult


class Oracle(Policy):
    """Verify exactly the accepted rows (known from an untimed full-verify prepass)."""

    name = "oracle"

    def __init__(self, gamma: int):
        self.num_drafts = gamma

    def plan(self, confidence_logits: Tensor, slots: Tensor, generations: Tensor,
             prepass: Callable[[], AcceptResult] | None = None) -> PolicyPlan:
        if prepass is None:
            raise ValueError("the oracle plans from a full verify of the step's drafts: pass `prepass`")
        return PolicyPlan(prepass().commit_lens.to(torch.int32))
