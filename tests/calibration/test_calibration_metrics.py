"""ECE (equal width / equal mass), Brier, NLL, AUROC, bootstrap and the margin baseline on hand cases."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dspark.calibration.metrics import (
    Sample,
    auroc,
    bootstrap_interval,
    brier,
    ece,
    ece_noise_floor,
    metric_functions,
    nll,
    paired_difference_interval,
    top2_margin,
)


def t(x, device):
    return torch.tensor(x, dtype=torch.float32, device=device)


def test_ece_equal_width_and_mass(device):
    p, y = t([0.1, 0.2, 0.3, 0.9], device), t([0, 0, 1, 1], device)
    # width, 2 bins: {.1,.2,.3} |0.6 - 1| + {.9} |0.9 - 1| -> 0.5 / 4
    assert ece(p, y, num_bins=2, strategy="width") == pytest.approx(0.125)
    # mass, 2 bins: {.1,.2} |0.3 - 0| + {.3,.9} |1.2 - 2| -> 1.1 / 4
    assert ece(p, y, num_bins=2, strategy="mass") == pytest.approx(0.275)
    assert ece(t([0.25, 0.75], device), t([0, 1], device), num_bins=1) == pytest.approx(0.0)
    assert ece(t([1.0], device), t([1.0], device), num_bins=10) == 0.0  # p = 1 falls in the last bin


def test_brier_nll_auroc(device):
    assert brier(t([0.1, 0.8], device), t([0, 1], device)) == pytest.approx(0.025)
    assert nll(t([0.5, 0.8], device), t([1, 0], device)) == pytest.approx((math.log(2) + math.log(5)) / 2, rel=1e-6)
    assert nll(t([0.0], device), t([1.0], device)) == pytest.approx(-math.log(1e-12))  # clamped, finite
    assert auroc(t([0.1, 0.4, 0.35, 0.8], device), t([0, 0, 1, 1], device)) == pytest.approx(0.75)
    assert auroc(t([0.5, 0.5, 0.2], device), t([0, 1, 0], device)) == pytest.approx(0.75)  # tie counts half
    assert math.isnan(auroc(t([0.1, 0.2], device), t([1, 1], device)))


def test_metric_bad_input_names_value(device):
    with pytest.raises(ValueError, match=r"probs\[1\] = 1.5"):
        brier(t([0.2, 1.5], device), t([0, 1], device))
    with pytest.raises(ValueError, match=r"labels\[0\] = nan"):
        nll(t([0.2], device), t([float("nan")], device))
    with pytest.raises(ValueError, match="empty"):
        ece(t([], device), t([], device))
    with pytest.raises(ValueError, match="0/1"):
        auroc(t([0.2, 0.3], device), t([0.5, 1], device))
    with pytest.raises(ValueError, match="strategy"):
        ece(t([0.2], device), t([0], device), strategy="quantile")


def test_bootstrap_interval_clusters():
    rng = np.random.default_rng(0)
    p = rng.uniform(size=400)
    y = (rng.uniform(size=400) < p).astype(float)
    groups = np.repeat(np.arange(100), 4)
    fns = metric_functions(10)
    sample = Sample.build(p, y, groups)
    ones = np.ones(400)
    for name, fn in fns.items():
        lo, hi = bootstrap_interval(fn, sample, 200, 0.9, np.random.default_rng(1))
        assert lo < hi and hi - lo < 0.2, name
        if not name.startswith("ece"):  # bootstrapped ECE is biased upwards; the rest bracket the point value
            assert lo < fn(sample, ones) < hi, name
    one = Sample.build(p, y, np.zeros(400))  # a single cluster: every resample is the full data
    lo1, hi1 = bootstrap_interval(fns["brier"], one, 20, 0.9, np.random.default_rng(1))
    assert lo1 == pytest.approx(fns["brier"](one, ones)) and hi1 == pytest.approx(lo1)


@given(st.integers(0, 2**32 - 1), st.integers(2, 30), st.integers(1, 40))
def test_paired_difference_interval_matches_brute_force(seed, clusters, num_samples):
    """Each replicate redraws the same clusters for both scorings; the interval is the percentiles of the
    per-replicate differences, computed here by expanding the drawn clusters' rows."""
    rng = np.random.default_rng(seed)
    groups = rng.integers(0, clusters, size=5 * clusters)
    groups[:clusters] = np.arange(clusters)  # every cluster has a row
    y = (rng.uniform(size=groups.size) < 0.5).astype(float)
    y[:2] = [0.0, 1.0]
    a, b = rng.uniform(size=groups.size), np.round(rng.uniform(size=groups.size), 1)
    fn = metric_functions(5)["auroc"]
    got = paired_difference_interval(fn, Sample.build(a, y, groups), Sample.build(b, y, groups), num_samples, 0.8,
                                      np.random.default_rng(seed))
    draw_rng, diffs = np.random.default_rng(seed), []
    _, idx = np.unique(groups, return_inverse=True)
    for _ in range(num_samples):
        counts = np.bincount(draw_rng.integers(0, clusters, clusters), minlength=clusters)
        rep = np.repeat(np.arange(groups.size), counts[idx])
        one = lambda s: fn(Sample.build(s[rep], y[rep]), np.ones(rep.size))  # noqa: E731
        diffs.append(one(a) - one(b))
    diffs = np.asarray(diffs)
    diffs = diffs[np.isfinite(diffs)]
    want = (np.quantile(diffs, 0.1), np.quantile(diffs, 0.9)) if diffs.size else (math.nan, math.nan)
    assert got == pytest.approx(want, abs=1e-12, nan_ok=True)


def test_paired_difference_interval_separates_what_single_intervals_cannot():
    """A small, consistent AUROC edge: the two single intervals overlap, the paired one excludes 0."""
    rng = np.random.default_rng(4)
    groups = np.repeat(np.arange(200), 5)
    base = rng.normal(size=1000)
    y = (rng.uniform(size=1000) < 1 / (1 + np.exp(-2 * base))).astype(float)
    noise = rng.normal(size=1000)
    better, worse = Sample.build(base + 0.3 * noise, y, groups), Sample.build(base + 0.45 * noise, y, groups)
    fn = metric_functions(10)["auroc"]
    lo_b, hi_b = bootstrap_interval(fn, better, 200, 0.95, np.random.default_rng(1))
    lo_w, hi_w = bootstrap_interval(fn, worse, 200, 0.95, np.random.default_rng(1))
    assert lo_b < hi_w  # the single intervals overlap
    lo, hi = paired_difference_interval(fn, better, worse, 200, 0.95, np.random.default_rng(1))
    assert 0 < lo < hi
    self_lo, self_hi = paired_difference_interval(fn, better, better, 50, 0.95, np.random.default_rng(1))
    assert self_lo == self_hi == 0.0
    with pytest.raises(ValueError, match="share their clusters, got 200 and 1"):
        paired_difference_interval(fn, better, Sample.build(base, y), 5, 0.95, np.random.default_rng(1))


def test_weighted_metrics_equal_replicated_rows():
    """A bootstrap weight of 2 must equal the row appearing twice (the fast bootstrap relies on it)."""
    rng = np.random.default_rng(2)
    p = np.round(rng.uniform(size=60), 1)  # many ties
    y = (rng.uniform(size=60) < p).astype(float)
    w = rng.integers(0, 3, size=60).astype(float)
    rep = np.repeat(np.arange(60), w.astype(int))
    for name, fn in metric_functions(7).items():
        weighted = fn(Sample.build(p, y), w[np.argsort(p, kind="stable")])
        expanded = fn(Sample.build(p[rep], y[rep]), np.ones(rep.size))
        if name == "ece_mass":  # a weighted row cannot straddle a bin edge: at most 2 * w_max per edge
            assert abs(weighted - expanded) <= 2 * 6 * w.max() / w.sum() and weighted != expanded
        else:
            assert weighted == pytest.approx(expanded, abs=1e-12), name


def test_top2_margin(device):
    x = t([[[1.0, 3.0, 2.0], [0.0, 0.0, -1.0]]], device)
    assert top2_margin(x).tolist() == [[1.0, 0.0]]
    with pytest.raises(ValueError, match="V >= 2"):
        top2_margin(t([[1.0]], device))


def test_ece_noise_floor_shrinks_with_data():
    rng = np.random.default_rng(3)
    small = ece_noise_floor(rng.uniform(size=200), 15, "width", 20, np.random.default_rng(0))
    large = ece_noise_floor(rng.uniform(size=20_000), 15, "width", 20, np.random.default_rng(0))
    assert 0.02 < small < 0.15 and large < 0.015 and large < small / 4  # ~ 1 / sqrt(n) per bin
    assert ece_noise_floor(np.array([0.0, 1.0, 1.0]), 10, "mass", 5, np.random.default_rng(0)) == 0.0


pairs = st.lists(st.tuples(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.5, 0.75, 0.9, 1.0]) | st.floats(0, 1),
                           st.sampled_from([0.0, 1.0])), min_size=1, max_size=40)


@given(pairs, st.integers(1, 12))
def test_metrics_match_brute_force(rows, num_bins):
    p = torch.tensor([r[0] for r in rows], dtype=torch.float64)
    y = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    pos, neg = [a for a, b in rows if b == 1], [a for a, b in rows if b == 0]
    if pos and neg:
        pairs_won = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg)
        assert auroc(p, y) == pytest.approx(pairs_won / (len(pos) * len(neg)))
    else:
        assert math.isnan(auroc(p, y))
    n = len(rows)
    width = {}
    for a, b in rows:
        width.setdefault(min(int(a * num_bins), num_bins - 1), []).append((a, b))
    by_rank = sorted(rows, key=lambda r: r[0])
    mass = {}
    for i, r in enumerate(by_rank):
        mass.setdefault(i * num_bins // n, []).append(r)
    for strategy, bins in (("width", width), ("mass", mass)):
        want = sum(abs(sum(a for a, _ in b) - sum(c for _, c in b)) for b in bins.values()) / n
        assert ece(p, y, num_bins=num_bins, strategy=strategy) == pytest.approx(want, abs=1e-12)
    assert brier(p, y) == pytest.approx(sum((a - b) ** 2 for a, b in rows) / n)
