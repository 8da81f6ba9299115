"""Non-negative least squares (with free coefficients) == brute force over active sets."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.cost.lsq import nonnegative_lstsq


def _brute_force(a: np.ndarray, y: np.ndarray, free: int) -> float:
    """Smallest residual over every subset of constrained columns (KKT point of each subset kept if feasible)."""
    p = a.shape[1] - free
    best = np.inf
    for mask in itertools.product([False, True], repeat=p):
        cols = list(range(free)) + [free + i for i in range(p) if mask[i]]
        x = np.zeros(a.shape[1])
        if cols:
            x[cols] = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
        if (x[free:] >= -1e-12).all():
            best = min(best, float(np.sum((a @ x - y) ** 2)))
    return best


@settings(max_examples=60)
@given(n=st.integers(1, 10), p=st.integers(0, 5), free=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
def test_matches_brute_force(n, p, free, seed):
    rng = np.random.default_rng(seed)
    a, y = rng.normal(size=(n, p + free)) * rng.uniform(0.1, 10), rng.normal(size=n)
    x = nonnegative_lstsq(a, y, free)
    assert x.shape == (p + free,) and (x[free:] >= 0).all()
    assert float(np.sum((a @ x - y) ** 2)) <= _brute_force(a, y, free) + 1e-9


def test_unconstrained_optimum_is_returned_when_feasible():
    rng = np.random.default_rng(1)
    a = rng.uniform(0.5, 1.5, size=(12, 3))
    x_true = np.array([0.5, 2.0, 0.25])
    assert nonnegative_lstsq(a, a @ x_true) == pytest.approx(x_true, abs=1e-9)
    assert nonnegative_lstsq(a, a @ np.array([-1.0, 2.0, 0.25]), free=1) == pytest.approx([-1.0, 2.0, 0.25], abs=1e-9)


def test_bad_shapes():
    with pytest.raises(ValueError, match="need a"):
        nonnegative_lstsq(np.zeros(3), np.zeros(3))
    with pytest.raises(ValueError, match="free must be"):
        nonnegative_lstsq(np.ones((3, 2)), np.zeros(3), free=3)
