"""Realised acceptance per draft position: what the adaptive policy's steps actually delivered lately.

Per draft position j the policy keeps moving averages of accepted and of verified drafts per request per
speculative step (draft j accepted within the verified rows; draft j verified), counted in request outcomes
with decay `decay` per outcome, started from and shrunk toward the mean of every plan's calibrated prediction
(the prior, worth `prior_weight` outcomes). A position a step does not observe (every position of a plain step,
the positions past a shallower step's depth) reverts toward its long-run mean with the same per-outcome decay.
Summed over positions 0..k-1 the averages predict a step drafting k: accepted and verified drafts per request.
Why each rule: docs/policies.md.
"""
from __future__ import annotations

import numpy as np


class RealisedAcceptance:
    """Moving averages [2, gamma] of (accepted, verified) drafts per request per step, per draft position."""

    def __init__(self, gamma: int, decay: float, prior_weight: int):
        self.gamma, self.decay, self.prior_weight = gamma, decay, prior_weight
        self.mean: np.ndarray | None = None  # [2, gamma] the moving averages, once any outcome was seen
        self.counts = np.zeros(gamma)  # request outcomes that drafted each position
        self.totals = np.zeros((2, gamma))  # accepted, verified per position summed over those outcomes
        self.predicted = np.zeros((2, gamma))  # the plans' calibrated predictions summed over the same
        self.prior: np.ndarray | None = None  # [2, gamma] mean prediction per outcome (prior_weight > 0)
        self.depth_seen = 0  # positions with outcomes: 0..depth_seen-1 (a step drafting k observes 0..k-1)
        self._positions = np.arange(gamma)

    def predict(self, depth: int) -> tuple[float, float] | None:
        """(accepted, verified) drafts per request of a step drafting `depth`; None before any outcome."""
        by_depth = self.by_depth()
        return None if by_depth is None else (by_depth[0][depth - 1], by_depth[1][depth - 1])

    def by_depth(self) -> tuple[list[float], list[float]] | None:
        """(accepted, verified) drafts per request of a step drafting 1..gamma (`predict` of every depth at
        once: the positions' averages summed left to right); None before any outcome."""
        if self.mean is None:
            return None
        accepted, verified = np.cumsum(self.mean, axis=1).tolist()
        return accepted, verified

    def observe_plan(self, verify_lens: np.ndarray, survival: np.ndarray, commit_lens: np.ndarray) -> None:
        """A speculative step's outcome: verify_lens [n] (root included), the plan's calibrated survival [n, k]
        (k: the step's depth; read only with prior_weight > 0), commit_lens [n]."""
        n, k = verify_lens.size, survival.shape[1]
        if n == 0:  # no request drafted: nothing observed
            return
        ends = np.empty((2, n), dtype=np.int64)  # accepted, verified
        np.minimum(commit_lens, verify_lens, out=ends[0])
        ends[1] = verify_lens
        ends -= 1
        within = self._positions[:k] < ends[:, :, None]  # [2, n, k]: draft j accepted / verified
        counts = within.sum(1)  # [2, k] outcomes per position
        seen = self.depth_seen  # positions seen..k-1 have their first outcomes
        self.counts[:k] += n
        if self.prior_weight:
            self.predicted[0, :k] += (survival * within[1]).sum(0)
            self.predicted[1, :k] += counts[1]
            self.prior = self.predicted / np.maximum(self.counts, 1)
        outcome = counts / n  # [2, k] per request outcome
        self.totals[:, :k] += n * outcome
        prior = self.prior_weight if self.prior is not None else 0
        w = np.maximum(1 - self.decay ** n, n / (self.counts[:k] + prior))
        if self.mean is None:
            self.mean = np.zeros((2, self.gamma))
        old = self.mean[:, :k]
        if k > seen:
            old = old.copy()
            old[:, seen:] = (self.prior if self.prior is not None else outcome)[:, seen:k]
            self.depth_seen = k
        self.mean[:, :k] = (1 - w) * old + w * outcome
        self._revert(k, n)

    def observe_plain(self, n: int) -> None:
        """A plain step of n requests: every position reverts toward its long-run mean."""
        self._revert(0, n)

    def _revert(self, first: int, n: int) -> None:
        """Positions first.. that have outcomes (first..depth_seen-1) move toward their long-run mean."""
        lo, hi = first, self.depth_seen
        if self.mean is None or lo >= hi:
            return
        totals, counts = self.totals[:, lo:hi], self.counts[lo:hi]
        if self.prior is not None:
            mean = (totals + self.prior_weight * self.prior[:, lo:hi]) / np.maximum(counts + self.prior_weight, 1)
        else:
            mean = totals / np.maximum(counts, 1)
        w = 1 - self.decay ** n
        self.mean[:, lo:hi] = (1 - w) * self.mean[:, lo:hi] + w * mean
