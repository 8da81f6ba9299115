"""RealisedAcceptance: per-position moving averages whose sums are the adaptive policy's scalar averages (the
rules of docs/policies.md, written out here as a brute-force reference), and positions a step does not draft
revert toward their long-run mean."""
from __future__ import annotations

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
