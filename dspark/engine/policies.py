"""Verify-budget policies: how many drafts to propose and how many rows each request verifies.

- `FixedK(k)`: draft k tokens, verify all of them (k = 0 is plain target-only decoding).
- `Adaptive(planner, plain_seconds, probe_every)`: draft gamma tokens, let dspark's VerifyPlanner pick
  per-request verify lengths from the calibrated confidence (lagged budget, live allocation, tier fill).
  Given the profiled plain-step time it first decides whether to speculate at all (see `speculate`).
- `Oracle(gamma)`: draft gamma tokens, verify exactly the rows that turn out to be accepted. The
  acceptance is found by a full static verify that is run *outside* the timed step (`prepass`), so its
  time is an upper bound on what any budget policy could reach with this draft and target.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from dspark.budget import choose_budget
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
    """dspark's VerifyPlanner: budget from lagged calibrated survival and the cost model, live allocation.

    Speculate or not: with `plain_seconds` (B -> seconds of a target-only step, profiled like the
    planner's cost model, which covers the whole speculative step: draft + plan + verify + accept),
    each step first compares the best speculative throughput the planner predicts from the *lagged*
    survival, theta* = max_b tau(b) / T(B, rows(b)), with the plain step's B / T_plain(B). When plain
    wins the decoder runs a target-only step (no draft forward). Plain steps produce no new survival,
    so after `probe_every` plain steps in a row the next step speculates anyway (a probe) to refresh
    the lagged survival. A probe costs a speculative step, so while probes keep confirming plain the
    interval doubles, up to `max_probe_every`; a step that speculates on its merits resets it
    (`max_probe_every = probe_every` probes at a fixed interval). The decision reads only survival of
    earlier steps (non-anticipating). One policy object serves one `generate` run (the probe state is
    per run). Without `plain_seconds` every step speculates.
    """

    prepass = False
    name = "adaptive"

    def __init__(self, planner: VerifyPlanner, plain_seconds: Callable[[int], float] | None = None,
                 probe_every: int = 8, max_probe_every: int = 64):
        for name, v, low in (("probe_every", probe_every, 1), ("max_probe_every", max_probe_every, probe_every)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if plain_seconds is not None and planner.ring is None:
            raise ValueError("speculate-or-not reads the lagged survival: the planner needs lag >= 1 "
                             "(or pass plain_seconds=None)")
        self.planner = planner
        self.num_drafts = planner.cfg.gamma
        self.plain_seconds = plain_seconds
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self._plain_run = 0  # plain steps since the last speculative step
        self._interval = probe_every  # plain steps before the next probe
        self._decided: tuple[int, bool] | None = None  # (B, speculate) until the lag ring changes

    def speculate(self, slots: Tensor, generations: Tensor) -> bool:
        """Before drafting: True to run a speculative step for these requests, False for a plain one."""
        if self.plain_seconds is None:
            return True
        if self._plain_run >= self._interval:  # probe
            self._plain_run = 0
            self._interval = min(2 * self._interval, self.max_probe_every)
            return True
        b = slots.numel()
        if self._decided is None or self._decided[0] != b:
            # requests only leave a run, so the same B means the same requests and the same lagged survival
            lagged = self.planner.ring.read(slots, generations)
            best = choose_budget(lagged, self.planner.cost_model, self.planner.cfg)
            self._decided = (b, best.theta > b / self.plain_seconds(b))
        if self._decided[1]:
            self._plain_run, self._interval = 0, self.probe_every
            return True
        self._plain_run += 1
        return False

    def plan(self, confidence_logits: Tensor, slots: Tensor, generations: Tensor) -> PolicyPlan:
        p = self.planner.plan(confidence_logits, slots, generations)
        self._decided = None  # the lag ring holds new survival
        return PolicyPlan(p.verify_lens, survival=p.survival, layout=p.layout, budget=p.budget)


class Oracle:
    """Verify exactly the accepted rows (known from an untimed full-verify prepass)."""

    prepass = True
    name = "oracle"

    def __init__(self, gamma: int):
        self.num_drafts = gamma
