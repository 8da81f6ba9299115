"""Sync-free planning (lag >= 1) equals the synchronous planner step for step over long random runs.

The sync-free planner budgets each step from the lag-ring row the previous step copied to the host, so its
rows and tier are fixed before the step; the synchronous one reads the lagged survival (or the device
decision) during the step. Same inputs must give the same budget decision, the same tier-fill budget and the
same verify_lens every step, with requests joining, leaving and slots reused under new generations.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark import AdditiveCostModel, BatchTerm, PlannerSettings, RowTerm, ScheduleConfig, VerifyPlanner
from dspark.kernels import dispatch
from dspark.verify.layout import round_up_to_tier

SLOTS = 24
FIXTURE = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def cost() -> AdditiveCostModel:
    return AdditiveCostModel(2e-3, BatchTerm([1, 16], [0.0, 1e-3]), RowTerm([0, 8, 40], [0.0, 0.4e-3, 8e-3]))


def run(seed: int, steps: int, gamma: int, device):
    """A continuous-batching trace: per step (logits, slots, generations); requests finish at random and
    their slots are reused by new requests under a new generation."""
    g = torch.Generator().manual_seed(seed)
    gens = torch.zeros(SLOTS, dtype=torch.int64)
    active = torch.randperm(SLOTS, generator=g)[: int(torch.randint(1, SLOTS, (1,), generator=g))]
    for _ in range(steps):
        done = torch.rand(active.numel(), generator=g) < 0.15
        gens[active[done]] += 1  # a finished request's slot gets a new generation when reused
        free = torch.tensor([s for s in range(SLOTS) if s not in set(active[~done].tolist())], dtype=torch.int64)
        joining = free[torch.randperm(free.numel(), generator=g)[: int(torch.randint(0, 4, (1,), generator=g))]]
        active = torch.cat([active[~done], joining])
        if not active.numel():
            active = free[:1]
        b = active.numel()
        scale = float(torch.rand((), generator=g)) * 4
        logits = torch.randn(b, gamma, generator=g) * scale + 1
        logits[torch.rand(b, gamma, generator=g) < 0.05] = -30.0  # candidates below survival_eps
        yield logits.to(device), active.clone(), gens[active].clone()


@FIXTURE
@given(seed=st.integers(0, 2**31 - 1), lag=st.integers(1, 3), gamma=st.integers(1, 6), floor=st.integers(1, 3),
       cap_gap=st.integers(0, 2), tiers=st.sampled_from([None, (8, 16, 32, 64, 128), (4, 8, 12, 24, 48, 96, 160)]),
       device_path=st.booleans())
def test_sync_free_equals_the_synchronous_planner(seed, lag, gamma, floor, cap_gap, tiers, device_path, device):
    floor = min(floor, gamma + 1)
    cfg = ScheduleConfig(gamma=gamma, min_verify_len=floor, max_verify_len=max(floor, gamma + 1 - cap_gap))
    with pytest.MonkeyPatch.context() as mp:
        if device_path and device.type == "cpu":
            mp.setenv(dispatch.BACKEND_ENV, "torch")  # the synchronous side plans on the device too
        planning = PlannerSettings(lag=lag, num_slots=SLOTS, tiers=tiers, graph_slots=SLOTS + 160 // cfg.width + 1)
        table = cost()
        sync = VerifyPlanner(cfg, table, planning, device=device)
        free = VerifyPlanner(cfg, table, dataclasses.replace(planning, sync_free=True), device=device)
        for step, (logits, slots, gens) in enumerate(run(seed, 120, gamma, device)):
            a, b = sync.plan(logits, slots, gens), free.plan(logits, slots, gens)
            where = f"step {step}"
            assert a.decision.budget == b.decision.budget, where
            if device_path or device.type != "cpu":  # the synchronous side summed on the device, in another order
                assert float(a.decision.tau) == pytest.approx(float(b.decision.tau), rel=1e-12), where
            else:
                assert a.decision.tau == b.decision.tau and a.decision.theta == b.decision.theta, where
            assert a.tier_budget == b.tier_budget, where
            assert torch.equal(a.verify_lens, b.verify_lens), where
            assert torch.equal(a.layout.qo_indptr, b.layout.qo_indptr), where
            real = a.layout.total_rows
            assert int(b.layout.real_rows) == real and int(b.layout.row_valid.sum()) == real, where
            assert torch.equal(a.layout.row_slot[:real], b.layout.row_slot[:real]), where
            assert torch.equal(a.layout.row_within[:real], b.layout.row_within[:real]), where
            n = logits.shape[0]
            tier = round_up_to_tier(n * cfg.floor + b.decision.budget, tiers) if tiers else None
            if tier is not None:  # fixed before the step: the tier the lagged budget rounds up to
                assert b.layout.graph_num_tokens == tier and b.layout.total_rows is None and b.budget is None, where
                assert a.layout.graph_num_tokens <= tier, where
            else:  # no tier fixes the rows: the sync-free layout read its total like the synchronous one
                assert b.layout.graph_num_tokens == a.layout.graph_num_tokens and b.budget == a.budget, where


@pytest.mark.parametrize("lag, parallel", [(0, None), (1, object())])
def test_sync_free_needs_a_lag_and_no_parallel_agreement(lag, parallel, device):
    with pytest.raises((ValueError, TypeError), match="sync_free=True needs lag >= 1|parallel"):
        VerifyPlanner(ScheduleConfig(gamma=3), cost(), PlannerSettings(lag=lag, sync_free=True), device=device,
                      parallel=parallel)


def test_sync_free_flag_must_be_a_bool(device):
    with pytest.raises(TypeError, match="sync_free"):
        VerifyPlanner(ScheduleConfig(gamma=3), cost(), PlannerSettings(sync_free=1), device=device)
