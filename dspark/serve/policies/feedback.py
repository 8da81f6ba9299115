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

import itertools


class RealisedAcceptance:
    """Moving averages [2][gamma] of (accepted, verified) drafts per request per step, per draft position.

    Host lists and Python floats throughout: a step folds in a few numbers per request and per position, and the
    policy runs between forwards that leave the caches cold, where each array operation costs tens of
    microseconds (perf/README.md, `policy_overhead.py --evict-mb`)."""

    def __init__(self, gamma: int, decay: float, prior_weight: int):
        self.gamma, self.decay, self.prior_weight = gamma, decay, prior_weight
        self.mean: list[list[float]] | None = None  # [2][gamma] the moving averages, once any outcome was seen
        self.counts = [0] * gamma  # request outcomes that drafted each position
        self.totals = [[0.0] * gamma, [0.0] * gamma]  # accepted, verified per position summed over those outcomes
        self.predicted = [[0.0] * gamma, [0.0] * gamma]  # the plans' calibrated predictions summed over the same
        self.prior: list[list[float]] | None = None  # [2][gamma] mean prediction per outcome (prior_weight > 0)
        self.depth_seen = 0  # positions with outcomes: 0..depth_seen-1 (a step drafting k observes 0..k-1)

    def predict(self, depth: int) -> tuple[float, float] | None:
        """(accepted, verified) drafts per request of a step drafting `depth`; None before any outcome."""
        by_depth = self.by_depth()
        return None if by_depth is None else (by_depth[0][depth - 1], by_depth[1][depth - 1])

    def by_depth(self) -> tuple[list[float], list[float]] | None:
        """(accepted, verified) drafts per request of a step drafting 1..gamma (`predict` of every depth at
        once: the positions' averages summed left to right); None before any outcome."""
        if self.mean is None:
            return None
        accepted, verified = (list(itertools.accumulate(row)) for row in self.mean)
        return accepted, verified

    def verified_distribution(self, depth: int) -> list[float]:
        """Distribution of the drafts one request verifies in a step drafting `depth`, host floats [depth + 1]
        (index: drafts verified), from the per-position averages of verified drafts (draft j verified, j < depth),
        each kept within the one before it. Needs an outcome (`mean`)."""
        reach, left = [1.0], 1.0  # P(the request verifies at least m drafts), m = 0..depth: non-increasing
        for q in self.mean[1][:depth]:
            left = min(left, max(q, 0.0))
            reach.append(left)
        return [reach[m] - reach[m + 1] for m in range(depth)] + [reach[depth]]

    def observe_plan(self, verify_lens: list[int], survival: list[list[float]], commit_lens: list[int]) -> None:
        """A speculative step's outcome, host lists of its n requests: verify_lens [n] in [1, k + 1] (root included),
        the plan's calibrated survival [n][k] (k: the step's depth; its values read only with prior_weight > 0),
        commit_lens [n] (a request's accepted drafts: min(commit, verify) - 1, none below 0)."""
        n = len(verify_lens)
        if n == 0:  # no request drafted: nothing observed
            return
        k = len(survival[0])
        # per request: drafts accepted and verified (within the verified rows), as histograms over 0..k
        accepted, verified, expected = [0] * (k + 1), [0] * (k + 1), [0.0] * k
        weigh = self.prior_weight > 0
        for v, c, row in zip(verify_lens, commit_lens, survival, strict=True):
            verified[v - 1] += 1
            accepted[max(min(c, v) - 1, 0)] += 1
            if weigh:
                for j in range(v - 1):
                    expected[j] += row[j]
        counts = []  # [2][k] outcomes per position: requests whose accepted / verified drafts reach past it
        for hist in (accepted, verified):
            reach, running = [0] * k, 0
            for j in range(k - 1, -1, -1):
                running += hist[j + 1]
                reach[j] = running
            counts.append(reach)
        seen, counted = self.depth_seen, self.counts  # positions seen..k-1 have their first outcomes
        for j in range(k):
            counted[j] += n
        if weigh:
            acc, ver = self.predicted
            for j in range(k):
                acc[j] += expected[j]
                ver[j] += counts[1][j]
            self.prior = [[p / max(c, 1) for p, c in zip(row, counted)] for row in self.predicted]
        outcome = [[c / n for c in row] for row in counts]  # [2][k] per request outcome
        for total, row in zip(self.totals, outcome):
            for j in range(k):
                total[j] += n * row[j]
        prior = self.prior_weight if self.prior is not None else 0
        first = 1 - self.decay ** n
        w = [max(first, n / (counted[j] + prior)) for j in range(k)]
        if self.mean is None:
            self.mean = [[0.0] * self.gamma, [0.0] * self.gamma]
        start = self.prior if self.prior is not None else outcome  # a position's first outcomes start from it
        for i, (mean, row) in enumerate(zip(self.mean, outcome)):
            for j in range(k):
                old = mean[j] if j < seen else start[i][j]
                mean[j] = (1 - w[j]) * old + w[j] * row[j]
        self.depth_seen = max(seen, k)
        self._revert(k, n)

    def observe_plain(self, n: int) -> None:
        """A plain step of n requests: every position reverts toward its long-run mean."""
        self._revert(0, n)

    def _revert(self, first: int, n: int) -> None:
        """Positions first.. that have outcomes (first..depth_seen-1) move toward their long-run mean."""
        if self.mean is None or first >= self.depth_seen:
            return
        w, counts = 1 - self.decay ** n, self.counts
        # without a prior, weight 0 adds exactly nothing
        weight, prior = (self.prior_weight, self.prior) if self.prior is not None else (0, [[0.0] * self.gamma] * 2)
        for mean, total, shrink in zip(self.mean, self.totals, prior):
            for j in range(first, self.depth_seen):
                long_run = (total[j] + weight * shrink[j]) / max(counts[j] + weight, 1)
                mean[j] = (1 - w) * mean[j] + w * long_run
