import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark import (
    AdditiveCostModel,
    BatchTerm,
    RowTerm,
    ScheduleConfig,
    StepsPerSecondTable,
    TieredCostModel,
    TierTerm,
    allocate_verify_lens,
    calibrated_survival,
    choose_budget,
    expected_commit,
    greedy_budget,
    tau_curve,
)
from tests.plan.test_allocate import cases


def cliff_table() -> StepsPerSecondTable:
    """A steps/s table with a cliff past 6 rows (the shape graph tiers give)."""
    return StepsPerSecondTable([1, 2, 4, 6, 7, 12, 20], [64.0, 60.0, 56.0, 52.0, 20.0, 18.0, 16.0])


def wavy_additive() -> AdditiveCostModel:
    return AdditiveCostModel(0.5, BatchTerm([1, 3, 8], [0.0, 0.25, 0.5]),
                             RowTerm([0, 3, 5, 9, 30], [0.0, 0.125, 1.0, 1.25, 4.0]))


def exhaustive_theta(s, cost, cfg):
    """theta(b) for every feasible b, each from an explicit allocation (no curve machinery)."""
    n_valid = int((torch.nan_to_num(s)[:, cfg.floor - 1: cfg.cap - 1] >= cfg.survival_eps).sum())
    out = []
    for b in range(n_valid + 1):
        vl = allocate_verify_lens(s, b, cfg)
        rows = int(vl.sum())
        assert rows == s.shape[0] * cfg.floor + b
        out.append(float(expected_commit(s, vl, cfg)) / cost.step_seconds(s.shape[0], rows))
    return out


def test_teaching_example(device):
    cfg = ScheduleConfig(gamma=2)
    s = calibrated_survival(torch.logit(torch.tensor([[0.9, 0.8], [0.6, 0.5]], dtype=torch.float64)).to(device))
    tau = tau_curve(s, cfg)
    assert tau.dtype == torch.float64 and tau.shape == (5,)
    assert tau.tolist() == pytest.approx([2.0, 2.9, 3.62, 4.22, 4.52], abs=1e-6)
    # the note's comparison: 2 extra rows at 1 ms beat 3 extra rows at 1.4 ms
    cost = StepsPerSecondTable([2, 4, 5], [1000.0, 1000.0, 1000.0 / 1.4])
    dec = choose_budget(s, cost, cfg)
    assert dec.budget == 2 and dec.rows == 4
    assert dec.tau == pytest.approx(3.62, abs=1e-6) and dec.theta == pytest.approx(3620.0, rel=1e-6)
    assert allocate_verify_lens(s, dec.budget, cfg).tolist() == [3, 1]


@pytest.mark.parametrize("cost", [cliff_table(), wavy_additive()], ids=["sps-cliff", "additive"])
@settings(max_examples=30)
@given(case=cases(max_b=4, max_gamma=4))
def test_choose_budget_equals_exhaustive_scan(cost, case, device):
    cfg, s, _ = case
    s = s.to(device)
    theta = exhaustive_theta(s, cost, cfg)
    best = max(theta)
    dec = choose_budget(s, cost, cfg)
    assert dec.budget == theta.index(best)
    assert dec.theta == best
    n = len(theta)
    assert dec.theta_curve.shape == (s.shape[0] * cfg.num_candidate_columns + 1,)  # every budget of a batch of B
    assert dec.theta_curve[:n].tolist() == pytest.approx(theta, rel=1e-12)
    assert bool((dec.theta_curve[n:] == -math.inf).all()) and bool((dec.tau_curve[n:] == dec.tau_curve[n - 1]).all())
    assert dec.num_candidates == n - 1 and dec.rows == s.shape[0] * cfg.floor + dec.budget


@pytest.mark.parametrize("cost", [cliff_table(), wavy_additive()], ids=["sps-cliff", "additive"])
@given(case=cases(max_b=4, max_gamma=4))
def test_greedy_equals_sequential_scan_with_early_stop(cost, case, device):
    """The scan's unit is a run of budgets at equal predicted seconds (the cliff table's flat buckets):
    the next run is admitted whole while the theta at its last budget beats the current run's."""
    cfg, s, _ = case
    theta = exhaustive_theta(s.to(device), cost, cfg)
    rows = s.shape[0] * cfg.floor
    seconds = [cost.step_seconds(s.shape[0], rows + b) for b in range(len(theta))]

    def run_end(b):
        while b + 1 < len(theta) and seconds[b + 1] == seconds[b]:
            b += 1
        return b

    b = run_end(0)
    while b + 1 < len(theta) and theta[run_end(b + 1)] > theta[b]:
        b = run_end(b + 1)
    dec = greedy_budget(s.to(device), cost, cfg)
    assert dec.budget == b and dec.theta <= choose_budget(s.to(device), cost, cfg).theta


def test_greedy_stops_at_the_first_local_maximum(device):
    cfg = ScheduleConfig(gamma=4, survival_eps=0.0)
    s = torch.tensor([[1.0, 1.0, 1.0, 1.0]], device=device)
    cost = StepsPerSecondTable([1, 2, 3, 4, 5], [10.0, 4.0, 3.0, 2.5, 10.0])
    assert greedy_budget(s, cost, cfg).budget == 0
    assert choose_budget(s, cost, cfg).budget == 4


def test_greedy_admits_a_paid_tier_whole(device):
    """A staircase cost: a tier's extra rows cost nothing once its first row is paid, so the scan compares
    tier tops; a row-by-row scan would stop at the first tier edge (one candidate never pays for a tier)."""
    cfg = ScheduleConfig(gamma=4)
    s = torch.tensor([[0.9, 0.8, 0.7, 0.6]] * 2, device=device)
    cost = TieredCostModel(0.1, BatchTerm([2], [0.0]), TierTerm([2, 4, 8, 10], [0.0, 0.05, 0.08, 0.5]))
    # theta at the tier tops: 2 / 0.1, 3.8 / 0.15, 6.8 / 0.18 (the argmax), 8 / 0.6
    assert greedy_budget(s, cost, cfg).budget == 6 == choose_budget(s, cost, cfg).budget


@settings(max_examples=30)
@given(case=cases(max_b=4, max_gamma=4), tiers=st.lists(st.integers(1, 20), min_size=1, max_size=5, unique=True))
def test_greedy_with_tiers_scans_tier_runs_on_a_cost_that_drifts_inside_a_tier(case, tiers, device):
    """With the step's tiers the scan's unit is a tier (a KV term makes every row cost a little more, so
    equal-seconds runs would be single rows and the scan would stop at the first tier edge)."""
    cfg, s, _ = case
    tiers = sorted(tiers)
    s = s.to(device)
    theta = exhaustive_theta(s, wavy_additive(), cfg)
    rows = s.shape[0] * cfg.floor

    def key(b):  # the tier rows + b replay, or past the largest a run of its own
        m = rows + b
        return next((i for i, t in enumerate(tiers) if t >= m), len(tiers) + m)

    def run_end(b):
        while b + 1 < len(theta) and key(b + 1) == key(b):
            b += 1
        return b

    b = run_end(0)
    while b + 1 < len(theta) and theta[run_end(b + 1)] > theta[b]:
        b = run_end(b + 1)
    assert greedy_budget(s, wavy_additive(), cfg, tiers=tiers).budget == b


def test_greedy_with_tiers_crosses_a_tier_edge_a_single_row_would_not(device):
    cfg = ScheduleConfig(gamma=2)
    s = torch.tensor([[0.9, 0.8]] * 2, device=device)
    # T = 1 s + 0.5 s per tier step + 0.01 s per row: theta 1.96, 1.90 (one row into tier 4 does not pay),
    # 2.47 (tier 4's top), 2.24, 2.62 (tier 6's top, the argmax)
    cost = AdditiveCostModel(1.0, BatchTerm([1, 4], [0.0, 0.0]),
                             RowTerm([2, 3, 4, 5, 6], [0.02, 0.53, 0.54, 1.05, 1.06]))
    assert greedy_budget(s, cost, cfg).budget == 0
    assert greedy_budget(s, cost, cfg, tiers=[2, 4, 6]).budget == 4 == choose_budget(s, cost, cfg).budget


def test_ties_go_to_the_smaller_budget(device):
    cfg = ScheduleConfig(gamma=3)
    s = torch.tensor([[1.0, 1.0, 0.25]], device=device)
    # theta(0) = 1 / 1 s, theta(1) = 2 / 2 s: a tie; theta(2) = 3 / 4 s
    cost = StepsPerSecondTable([1, 2, 3], [1.0, 0.5, 0.25])
    dec = choose_budget(s, cost, cfg)
    assert dec.budget == 0 and dec.theta_curve[:3].tolist() == [1.0, 1.0, 0.75]


def test_floor_and_cap_window(device):
    s = torch.tensor([[0.9, 0.8, 0.7, 0.6], [0.5, 0.4, 0.3, 0.2]], device=device)
    cfg = ScheduleConfig(gamma=4, min_verify_len=2, max_verify_len=4)
    tau = tau_curve(s, cfg)
    # floor: 2 roots + drafts 0 of both requests; candidates: columns 1..2
    assert tau.tolist() == pytest.approx([3.4, 4.2, 4.9, 5.3, 5.6], abs=1e-6)


def test_eps_cut_and_empty_batch(device):
    cfg = ScheduleConfig(gamma=2, survival_eps=0.5)
    s = torch.tensor([[0.9, 0.4], [math.nan, 0.9]], device=device)
    assert tau_curve(s, cfg).tolist() == pytest.approx([2.0, 2.9, 2.9, 2.9, 2.9], abs=1e-6)  # one candidate
    dec = choose_budget(torch.zeros(0, 2, device=device), cliff_table(), cfg)
    assert (dec.budget, dec.tau, dec.rows) == (0, 0.0, 0) and dec.theta_curve.shape == (1,)
    assert greedy_budget(torch.zeros(0, 2, device=device), cliff_table(), cfg).budget == 0


def test_tau_equals_expected_commit_by_enumeration(device):
    """With survival = the true acceptance probabilities, tau(b) = E[sum commit_lens] (enumerated)."""
    cond = [[0.9, 0.7, 0.4], [0.6, 0.95, 0.5]]
    cfg = ScheduleConfig(gamma=3)
    s = torch.cumprod(torch.tensor(cond, dtype=torch.float64), 1).float().to(device)

    def dist(c):  # P(correct_lens = k), k = 0..gamma
        probs, alive = [], 1.0
        for ci in c:
            probs.append(alive * (1 - ci))
            alive *= ci
        return probs + [alive]

    tau = tau_curve(s, cfg)
    for b in range(tau.numel()):
        vl = allocate_verify_lens(s, b, cfg).tolist()
        expected = 0.0
        for ks in itertools.product(range(4), repeat=2):
            p = math.prod(dist(cond[r])[k] for r, k in enumerate(ks))
            expected += p * sum(min(k, vl[r] - 1) + 1 for r, k in enumerate(ks))
        assert float(tau[b]) == pytest.approx(expected, abs=1e-6)


def test_expected_commit_validates(device):
    cfg = ScheduleConfig(gamma=2)
    s = torch.full((2, 2), 0.5, device=device)
    with pytest.raises(ValueError, match=r"verify_lens\[1\] = 4"):
        expected_commit(s, torch.tensor([1, 4], device=device), cfg)
    with pytest.raises(ValueError, match=r"\[B=2\]"):
        expected_commit(s, torch.tensor([1], device=device), cfg)
    with pytest.raises(TypeError, match="float32"):
        expected_commit(s, torch.tensor([1.0, 2.0], device=device), cfg)
    with pytest.raises(TypeError, match="list"):
        expected_commit(s, [1, 2], cfg)


def test_choose_budget_validates(device):
    cfg = ScheduleConfig(gamma=2)
    with pytest.raises(TypeError, match="dict"):
        choose_budget(torch.full((2, 2), 0.5, device=device), {"rows": [1]}, cfg)
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        choose_budget(torch.full((2, 3), 0.5, device=device), cliff_table(), cfg)
    with pytest.raises(TypeError, match="int64"):
        tau_curve(torch.ones(2, 2, dtype=torch.int64, device=device), cfg)


@settings(max_examples=40)
@given(b=st.integers(1, 12), gamma=st.integers(1, 7), seed=st.integers(0, 2**32 - 1))
def test_greedy_scan_finds_the_argmax_when_cost_is_convex_in_rows(b, gamma, seed, device):
    """tau concave in the budget (best candidates first) over T convex in the rows: theta is unimodal, so
    the synchronous early-stop scan reaches the free argmax (the reason the demo fits convex rows)."""
    rng = np.random.default_rng(seed)
    survival = torch.from_numpy(rng.uniform(0, 1, size=(b, gamma)).astype(np.float32)).to(device)
    # the probes must reach B*W, the most rows a step can verify: past the last probe T is held flat,
    # which is not convex, and the scan may stop at a local maximum there
    rows = sorted({*range(1, b * (gamma + 1), max(1, b // 2)), b * (gamma + 1)})
    slopes = np.cumsum(rng.uniform(0, 2e-4, len(rows) - 1))
    theta = np.concatenate([[0.0], np.cumsum(slopes * np.diff(rows))])
    model = AdditiveCostModel(float(rng.uniform(1e-3, 5e-3)), BatchTerm([1], [0.0]), RowTerm(rows, theta.tolist()))
    cfg = ScheduleConfig(gamma=gamma)
    greedy, free = greedy_budget(survival, model, cfg), choose_budget(survival, model, cfg)
    assert greedy.theta >= free.theta * (1 - 1e-9)
