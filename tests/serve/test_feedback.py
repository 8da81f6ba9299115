"""RealisedAcceptance: per-position moving averages whose sums are the adaptive policy's scalar averages (the
rules of docs/policies.md, written out here as a brute-force reference), and positions a step does not draft
revert toward their long-run mean."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.serve.policies.feedback import RealisedAcceptance

pytestmark = pytest.mark.cpu_only(reason="host-side bookkeeping")
GAMMA = 3


class ScalarReference:
    """The scalar rules: EMAs of (accepted, verified) drafts per request, prior = mean plan prediction."""

    def __init__(self, decay: float, prior_weight: int):
        self.decay, self.prior_weight = decay, prior_weight
        self.realised = None
        self.prior = None
        self.observed, self.totals, self.predicted = 0, [0.0, 0.0], [0.0, 0.0]

    def plan(self, vl, surv, commit):
        n = vl.size
        if self.prior_weight:
            expected = sum(surv[r, :vl[r] - 1].sum() for r in range(n))
            self.predicted = [self.predicted[0] + expected, self.predicted[1] + float(vl.sum()) - n]
            self.prior = [p / (self.observed + n) for p in self.predicted]
        acc, ver = float(np.maximum(np.minimum(commit, vl) - 1, 0).mean()), float((vl - 1).mean())
        self.observed += n
        self.totals = [self.totals[0] + n * acc, self.totals[1] + n * ver]
        prior = self.prior_weight if self.prior is not None else 0
        w = max(1 - self.decay ** n, n / (self.observed + prior))
        old = self.realised if self.realised is not None else (self.prior or [acc, ver])
        self.realised = [(1 - w) * old[0] + w * acc, (1 - w) * old[1] + w * ver]

    def plain(self, n):
        if self.realised is None:
            return
        w = 1 - self.decay ** n
        prior, weight = (self.prior, self.prior_weight) if self.prior is not None else ([0.0, 0.0], 0)
        mean = [(t + weight * p) / (self.observed + weight) for t, p in zip(self.totals, prior)]
        self.realised = [(1 - w) * r + w * m for r, m in zip(self.realised, mean)]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), prior_weight=st.sampled_from([0, 16]), decay=st.sampled_from([0.5, 0.985]),
       steps=st.lists(st.tuples(st.integers(1, 6), st.booleans()), min_size=1, max_size=12))
def test_sums_over_positions_follow_the_scalar_rules_at_every_depth(seed, prior_weight, decay, steps) -> None:
    # at full depth, positions 0..d-1 summed are the scalar rules applied to the drafts cut at d
    rng = np.random.default_rng(seed)
    mine = RealisedAcceptance(GAMMA, decay, prior_weight)
    refs = {d: ScalarReference(decay, prior_weight) for d in range(1, GAMMA + 1)}
    for n, plain in steps:
        if plain:
            mine.observe_plain(n)
            for ref in refs.values():
                ref.plain(n)
            continue
        vl = rng.integers(1, GAMMA + 2, n)
        commit = rng.integers(0, GAMMA + 2, n)  # 0: nothing accepted (not even counted as -1)
        surv = np.cumprod(rng.uniform(0.05, 1.0, (n, GAMMA)), 1)
        mine.observe_plan(vl.tolist(), surv.tolist(), commit.tolist())
        for d, ref in refs.items():
            ref.plan(np.minimum(vl, d + 1), surv, commit)
    for d, ref in refs.items():
        if ref.realised is None:
            assert mine.predict(d) is None and mine.by_depth() is None
        else:
            assert mine.by_depth()[0][d - 1] == pytest.approx(ref.realised[0], rel=1e-9, abs=1e-12), d
            assert mine.predict(d) == pytest.approx(tuple(ref.realised), rel=1e-9, abs=1e-12), d


def test_a_shallow_step_updates_its_positions_and_reverts_the_others() -> None:
    fb = RealisedAcceptance(GAMMA, 0.5, 0)
    fb.observe_plan([GAMMA + 1] * 2, [[1.0] * GAMMA] * 2, [GAMMA + 1] * 2)  # every draft verified and accepted
    assert fb.predict(GAMMA) == pytest.approx((3.0, 3.0))
    # depth 1, nothing accepted: position 0 moves to 0; positions 1, 2 revert toward their long-run mean (1, 1)
    fb.observe_plan([2, 2], [[1.0], [1.0]], [1, 1])
    acc, ver = fb.predict(1)
    assert acc < 1.0 and ver == pytest.approx(1.0)
    assert fb.mean[0][1:] == pytest.approx([1.0, 1.0]) and fb.counts == [4, 2, 2]
    assert fb.predict(GAMMA)[0] == pytest.approx(acc + 2.0)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), depth=st.integers(1, GAMMA),
       steps=st.lists(st.integers(1, 5), min_size=1, max_size=6))
def test_verified_distribution_is_one_requests_count_of_verified_drafts(seed, depth, steps) -> None:
    rng = np.random.default_rng(seed)
    fb = RealisedAcceptance(GAMMA, 0.9, 0)
    for n in steps:  # depths drawn too: a shallow step leaves the deeper positions to revert
        k = int(rng.integers(1, GAMMA + 1))
        vl = rng.integers(1, k + 2, n)
        fb.observe_plan(vl.tolist(), np.ones((n, k)).tolist(), rng.integers(0, k + 2, n).tolist())
    got = fb.verified_distribution(depth)
    assert len(got) == depth + 1 and sum(got) == pytest.approx(1.0, abs=1e-12) and min(got) >= 0.0
    # P(at least m + 1 drafts verified) is the average at position m, made non-increasing along the block
    reach = np.minimum.accumulate(np.clip(fb.mean[1][:depth], 0.0, 1.0))
    assert [sum(got[m + 1:]) for m in range(depth)] == pytest.approx(reach.tolist(), abs=1e-12)
    if all(x >= y for x, y in itertools.pairwise(fb.mean[1][:depth])):  # then its mean is the depth's average
        assert sum(v * p for v, p in enumerate(got)) == pytest.approx(fb.predict(depth)[1], rel=1e-9, abs=1e-12)


def test_verified_distribution_keeps_a_rising_average_within_the_one_before() -> None:
    fb = RealisedAcceptance(GAMMA, 0.5, 0)
    fb.mean = [[0.0] * GAMMA, [0.5, 0.7, 0.2]]  # position 1 verified more often than position 0: impossible
    assert fb.verified_distribution(GAMMA) == pytest.approx([0.5, 0.0, 0.3, 0.2])
    assert fb.verified_distribution(1) == pytest.approx([0.5, 0.5])
