"""The planner's shortcut when a step verifies every candidate: `full_window_bound` is sound (every candidate at
or above it makes the scan take the whole window, argmax and greedy, with or without tiers), and a planner that
takes the shortcut returns what the full scan and allocation return, field for field."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dspark.plan.planner as planner_module
from dspark import (
    AdditiveCostModel,
    BatchTerm,
    PlannerSettings,
    RowTerm,
    ScheduleConfig,
    TieredCostModel,
    TierTerm,
    VerifyPlanner,
)
from dspark.plan.budget import HostSurvival, full_window_bound, host_decision, seconds_over_window

pytestmark = pytest.mark.cpu_only(reason="the host planning path: numpy on the CPU")

COSTS = {
    "rising rows": AdditiveCostModel(2e-3, BatchTerm([1, 16], [0.0, 1e-3]), RowTerm([0, 8, 40], [0.0, 0.4e-3, 8e-3])),
    "flat": AdditiveCostModel(5e-3, BatchTerm([1, 16], [0.0, 1e-3]), RowTerm([0, 64], [0.0, 0.0])),
    "tiered": TieredCostModel(2e-3, BatchTerm([1, 16], [0.0, 1e-3]),
                              TierTerm([2, 4, 8, 16, 32, 64], [0.0, 1e-4, 3e-4, 9e-4, 3e-3, 9e-3])),
}
TIERS = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def schedule(gamma: int, floor: int, cap: int | None) -> ScheduleConfig:
    return ScheduleConfig(gamma=gamma, min_verify_len=floor, max_verify_len=cap)


def at_the_bound(rng: np.random.Generator, b: int, cfg: ScheduleConfig, bound: float, worst: bool) -> np.ndarray:
    """float32 [B, gamma] non-increasing rows whose candidates are float32(bound) (the least a step can hold and
    still take the shortcut) or, above it, 1 (worst: the most tau a budget can have) or uniform draws."""
    v = np.float32(bound)
    top = rng.integers(0, cfg.num_candidate_columns + 1, b)  # per row: candidates above the bound
    s = np.full((b, cfg.gamma), v, dtype=np.float32)
    s[:, : cfg.floor - 1] = 1.0
    for r, t in enumerate(top):
        cols = slice(cfg.floor - 1, cfg.floor - 1 + t)
        s[r, cols] = 1.0 if worst else np.sort(rng.uniform(bound, 1.0, t).astype(np.float32))[::-1]
    s[:, cfg.cap - 1:] = rng.uniform(0.0, 1.0) * v  # past the cap: not candidates
    return np.ascontiguousarray(np.maximum(np.minimum.accumulate(s, axis=1), 0))


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 24), gamma=st.integers(1, 6), floor=st.integers(1, 3),
       cap_cut=st.integers(0, 2), cost=st.sampled_from(sorted(COSTS)), greedy=st.booleans(), tiered=st.booleans(),
       worst=st.booleans())
def test_candidates_at_the_bound_make_the_scan_take_every_one(seed, b, gamma, floor, cap_cut, cost, greedy,
                                                               tiered, worst) -> None:
    floor = min(floor, gamma + 1)
    cfg = schedule(gamma, floor, max(floor, gamma + 1 - cap_cut))
    model = COSTS[cost]
    tiers = TIERS if tiered else None
    seconds = seconds_over_window(model, b, cfg).numpy()
    bound = full_window_bound(seconds, b, cfg, greedy=greedy, tiers=tiers)
    n = b * cfg.num_candidate_columns
    if n == 0 or not np.isfinite(seconds).all():  # no candidate, or rows past the largest tier: never shortcut
        assert bound == float("inf")
        return
    assert cfg.survival_eps <= bound < float("inf")
    if bound > 1.0:  # no survival can reach it: the shortcut never applies
        return
    s = at_the_bound(np.random.default_rng(seed), b, cfg, bound, worst)
    window = s[:, cfg.floor - 1: cfg.cap - 1]
    if not window.min() >= bound:  # float32(bound) rounded below it: the planner would not take the shortcut
        return
    budget, decision = host_decision(HostSurvival(s), model, cfg, greedy=greedy, seconds=seconds, tiers=tiers)
    assert budget == n and int(decision.budget) == n


def test_the_bound_follows_the_price_of_rows() -> None:
    # nearly free rows: any confident step takes the shortcut; rows that double the step: almost none does
    cfg = schedule(4, 1, None)
    flat, rising = (seconds_over_window(COSTS[c], 4, cfg).numpy() for c in ("flat", "rising rows"))
    for greedy in (False, True):
        assert full_window_bound(flat, 4, cfg, greedy=greedy, tiers=TIERS) < 1e-5
        assert full_window_bound(rising, 4, cfg, greedy=greedy, tiers=TIERS) > 0.5
    assert full_window_bound(seconds_over_window(COSTS["rising rows"], 1, cfg).numpy(), 1, cfg, greedy=False) < 0.1


def assert_same_plan(a, r) -> None:
    assert torch.equal(a.verify_lens, r.verify_lens) and a.verify_lens.dtype == r.verify_lens.dtype
    assert (a.budget, a.tier_budget, a.step_seconds) == (r.budget, r.tier_budget, r.step_seconds)
    for name in ("qo_indptr", "slot_lens", "slot_qo_indptr", "seqused", "row_slot", "row_within"):
        assert torch.equal(getattr(a.layout, name), getattr(r.layout, name)), name
    assert (a.layout.total_rows, a.layout.tier, a.layout.graph_num_tokens) == (
        r.layout.total_rows, r.layout.tier, r.layout.graph_num_tokens)


def assert_same_decision(a, r) -> None:
    for name in ("budget", "tau_curve", "step_seconds_curve", "theta_curve"):
        assert torch.equal(getattr(a.decision, name), getattr(r.decision, name)), name
    assert a.decision.base_rows == r.decision.base_rows


def planners(cfg, cost, settings_):
    """(a planner that may take the shortcut and records whether it did, one that always scans)."""
    temps = [1.0, 0.8, 1.2, 1.0][: cfg.gamma]
    fast, full = (VerifyPlanner(cfg, COSTS[cost], settings_, temperatures=temps) for _ in range(2))
    full._takes_all = lambda *args, **kwargs: False
    taken, original = [], fast._takes_all
    fast._takes_all = lambda *args, **kwargs: taken.append(original(*args, **kwargs)) or taken[-1]
    return fast, full, taken


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 16), lag=st.sampled_from([0, "0 argmax", 1, 2]),
       cost=st.sampled_from(sorted(COSTS)), tiered=st.booleans(), shift=st.floats(-1.0, 6.0),
       floor=st.sampled_from([1, 2]), cap_cut=st.sampled_from([0, 1]), eps=st.sampled_from([1e-6, 0.3]))
def test_the_shortcut_plans_what_the_scan_plans(seed, b, lag, cost, tiered, shift, floor, cap_cut, eps) -> None:
    cfg = ScheduleConfig(gamma=4, min_verify_len=floor, max_verify_len=5 - cap_cut, survival_eps=eps)
    live_argmax = lag == "0 argmax"  # lag 0, the budget by the argmax over live survival
    fast, full, taken = planners(cfg, cost, PlannerSettings(lag=0 if live_argmax else lag, num_slots=16,
                                                            tiers=TIERS if tiered else None, live_argmax=live_argmax))
    gen = torch.Generator().manual_seed(seed)
    slots, gens = torch.arange(b), torch.zeros(b, dtype=torch.int64)
    plans = []
    for _ in range(4):
        logits = torch.randn(b, 4, generator=gen) * 2 + shift
        plans.append((fast.plan(logits, slots, gens), full.plan(logits, slots, gens)))
        assert_same_plan(*plans[-1])
    for a, r in plans:  # the curves read after later steps
        assert_same_decision(a, r)
    if shift >= 5.0 and cost == "flat" and eps < 0.1:  # confident drafts where rows are free: the shortcut served
        assert any(taken)


def test_a_lagged_budget_takes_the_shortcut_only_when_every_live_draft_counts() -> None:
    # lag 1, fresh slots: the budget reads all-ones rows (take all); a live draft below survival_eps is no candidate
    cfg = ScheduleConfig(gamma=4, survival_eps=1e-3)
    fast, full, taken = planners(cfg, "flat", PlannerSettings(lag=1, num_slots=4))
    slots, gens = torch.arange(3), torch.zeros(3, dtype=torch.int64)
    logits = torch.full((3, 4), 6.0)
    logits[1, 3] = -20.0
    a, r = fast.plan(logits, slots, gens), full.plan(logits, slots, gens)
    assert taken == [False] and a.verify_lens.tolist() == [5, 4, 5]
    assert_same_plan(a, r)
    assert_same_decision(a, r)
    fast.plan(torch.full((3, 4), 6.0), slots, gens)  # the budget reads step 1's rows: one too unsure for it
    a = fast.plan(torch.full((3, 4), 6.0), slots, gens)
    assert taken == [False, False, True] and a.verify_lens.tolist() == [5, 5, 5]


def test_a_confident_step_skips_the_scan(monkeypatch) -> None:
    planner = VerifyPlanner(ScheduleConfig(gamma=4), COSTS["flat"], PlannerSettings(lag=0))
    calls = []
    scan = planner_module.host_choice
    monkeypatch.setattr(planner_module, "host_choice", lambda *a, **k: calls.append(1) or scan(*a, **k))
    plan = planner.plan(torch.full((3, 4), 8.0), torch.arange(3), torch.zeros(3, dtype=torch.int64))
    assert calls == [] and plan.verify_lens.tolist() == [5, 5, 5] and plan.budget == 12
    assert int(plan.decision.budget) == 12 and calls == [1]  # the curves on first access, once
    assert int(plan.decision.budget) == 12 and calls == [1]
    # one unconfident request: the scan runs
    unsure = torch.tensor([[8.0] * 4, [8.0, -9.0, -9.0, -9.0]])
    planner.plan(unsure, torch.arange(2), torch.zeros(2, dtype=torch.int64))
    assert calls == [1, 1]
