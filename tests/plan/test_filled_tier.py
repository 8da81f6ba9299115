"""`filled_tier_seconds` (`VerifyPlanner.filled_seconds_window`): the adaptive policy prices a depth's predicted
rows with each tier's padding shared out (written out here as a brute-force loop over runs of equal prices)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.plan.budget import filled_tier_seconds

pytestmark = pytest.mark.cpu_only(reason="host-side arithmetic of the gate")


def _reference(window: list[float]) -> list[float]:
    runs, start = [], 0  # (first, last) budget of each run of equal prices
    for i in range(1, len(window) + 1):
        if i == len(window) or window[i] != window[i - 1]:
            runs.append((start, i - 1))
            start = i
    out = list(window)
    for (first, last), (_, prev) in zip(runs[1:], runs):
        for i in range(first, last + 1):
            out[i] = min(window[i], window[prev] + (i - prev) / (last - prev) * (window[i] - window[prev]))
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-4, 1.0), st.integers(1, 9)), min_size=1, max_size=12))
def test_matches_the_loop_over_runs_of_equal_prices(runs: list[tuple[float, int]]) -> None:
    window = np.array([price for price, length in runs for _ in range(length)], dtype=np.float64)
    got = filled_tier_seconds(window)
    assert got.dtype == np.float64 and got.shape == window.shape
    np.testing.assert_allclose(got, _reference(window.tolist()), rtol=1e-12, atol=0)
    last = np.r_[window[1:] != window[:-1], True]
    np.testing.assert_array_equal(got[last], window[last])  # a tier's last budget pays the tier
    assert (got <= window).all()  # filling a tier never costs more than the tier


def test_an_untiered_window_is_unchanged_and_a_tier_is_shared_out() -> None:
    smooth = np.linspace(0.1, 0.2, 17)
    np.testing.assert_array_equal(filled_tier_seconds(smooth), smooth)
    tiered = np.array([1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 3.0])  # budgets 2..5 share one tier
    np.testing.assert_allclose(filled_tier_seconds(tiered), [1.0, 1.0, 1.25, 1.5, 1.75, 2.0, 3.0])
    cheaper = np.array([3.0, 2.0, 2.0])  # a cheaper tier after a dearer one keeps its own price
    np.testing.assert_array_equal(filled_tier_seconds(cheaper), cheaper)
