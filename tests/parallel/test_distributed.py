"""TP/DP agreement on real torch.distributed (gloo on CPU, ranks spawned here, hard timeouts).

One 4-rank launch runs every multi-process scenario at 4 ranks, then at 2 ranks (a process group of
ranks 0 and 1), over a thousand steps in all; the tests below assert on what the ranks returned. A hang
fails the launch after LAUNCH_TIMEOUT (workers killed); a stuck collective errors after 60 s.
In-process tests use a one-rank gloo group.
"""
from __future__ import annotations

import functools
import os
import tempfile
import time

import distributed_workers as w
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.config import ScheduleConfig
from dspark.parallel import (
    DpTierAgreement,
    EstimatorAgreement,
    ParallelConfig,
    TpAgreement,
    check_cost_table,
    check_planning_config,
    verify_lens_hash,
)
from dspark.parallel.launch import run_local_gloo
from dspark.plan.planner import PlannerSettings, VerifyPlanner
from dspark.verify.layout import round_up_to_tier

STEPS = {  # per launch; spawning ranks dominates the wall time, so each launch runs many steps
    2: {"verify": 600, "broadcast": 200, "dp": 60, "planner": 30, "estimator": 400, "estimator_drift": 120,
        "drift_step": 45},
    4: {"verify": 300, "broadcast": 100, "dp": 30, "planner": 30, "estimator": 240, "estimator_drift": 120,
        "drift_step": 45},
}
INJECT = {5: "value", 9: "batch", 12: "type"}
LAUNCH_TIMEOUT = 150.0


@pytest.fixture(scope="module")
def launches():
    """One 4-rank launch runs every scenario at 4 ranks, then at 2 (ranks 0 and 1, a sub-group)."""
    cache: list[list[dict]] = []

    def get(world: int) -> list[dict]:
        if not cache:
            cache.append(run_local_gloo(w.scenarios, max(STEPS), args=(STEPS, INJECT), timeout=LAUNCH_TIMEOUT,
                                        collective_timeout=60.0))
        ranks = [r[world] for r in cache[0] if world in r]
        assert len(ranks) == world
        return ranks

    return get


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo world in this process (FileStore in a temp dir: parallel runs never collide)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "s"), 1), rank=0, world_size=1)
        yield
        dist.destroy_process_group()


def _hash_reference(lens: list[int]) -> list[int]:
    """Python big-int reference of verify_lens_hash."""
    out = []
    for p, g in ((2_147_483_647, 48_271), (2_147_483_629, 69_621)):
        x = [len(lens), *lens]
        out.append(sum(v * pow(g, k + 1, p) for k, v in enumerate(x)) % p)
    return out


def check_layout(d: dict, width: int, slots: int) -> None:
    """Invariants of a RaggedVerifyLayout summary (see distributed_workers.layout_summary)."""
    b, rows = d["requests"], d["graph"]
    assert d["lens"] == d["slot_lens"][:b] == d["seqused"][:b]
    assert d["total"] == sum(d["lens"]) and rows >= d["total"]
    assert len(d["slot_lens"]) == slots and all(0 <= n <= width for n in d["slot_lens"])
    assert all(u == 0 for u in d["seqused"][b:]), "ghost slots must have seqused 0"
    assert sum(d["slot_lens"]) == rows and d["slot_qo"][-1] == rows and d["slot_qo"][0] == 0
    assert d["qo"] == d["slot_qo"][: b + 1]
    assert len(d["row_slot"]) == len(d["row_within"]) == rows
    for i, (s, j) in enumerate(zip(d["row_slot"], d["row_within"])):
        assert d["slot_qo"][s] + j == i and 0 <= j < d["slot_lens"][s]
    assert d["width"] == width


@pytest.mark.parametrize("world", [2, 4])
def test_tp_verify_mode_identical_lens_every_step(launches, world):
    ranks = launches(world)
    ref = ranks[0]["verify"]["agreed"]
    assert len(ref) == STEPS[world]["verify"]
    for r in ranks:
        assert r["verify"]["agreed"] == ref
        assert r["verify"]["local"] == r["verify"]["agreed"]
    for step in range(0, STEPS[world]["verify"], 97):
        assert ref[step] == w.replicated_lens(step).tolist()


@pytest.mark.parametrize("world", [2, 4])
def test_tp_broadcast_mode_takes_first_rank_lens(launches, world):
    ranks = launches(world)
    first = ranks[0]["broadcast"]["local"]
    assert len(first) == STEPS[world]["broadcast"]
    for r in ranks:
        assert r["broadcast"]["agreed"] == first
    for r in ranks[1:]:
        differ = sum(a != b for a, b in zip(r["broadcast"]["local"], first))
        assert differ == len(first), "non-first ranks must start from different lens"


def _errors(events: list) -> dict[int, tuple[str, list]]:
    return {step: (message, bad) for step, message, bad in events if bad is not None}


@pytest.mark.parametrize("world", [2, 4])
def test_injected_disagreement_detected_same_step_on_every_rank(launches, world):
    for r in launches(world):
        errors = _errors(r["injected"])
        assert sorted(errors) == sorted(INJECT)
        for message, bad in errors.values():
            assert bad == [world - 1]
            assert f"ranks [{world - 1}] differ from rank 0" in message
            assert f"ranks {list(range(world - 1))} hold verify_lens hash" in message
        assert f"(B={w.replicated_lens(9).shape[0]})" in errors[9][0]
        assert f"ranks [{world - 1}] hold invalid verify_lens" in errors[12][0]


@pytest.mark.parametrize("world", [2, 4])
def test_broadcast_mode_detects_another_batch_size_same_step_on_every_rank(launches, world):
    """Broadcast mode once returned different lens silently when B differed ([2, 3] on one rank, [2, 3, 4]
    on the other); now every rank raises in that step, naming the rank; a differing value is overwritten."""
    ranks = launches(world)
    for rank, r in enumerate(ranks):
        events = r["broadcast_injected"]
        errors = _errors(events)
        assert sorted(errors) == [9, 12], errors
        b = w.replicated_lens(9).shape[0]
        other = b - 1 if b > 1 else 2 * b
        assert errors[9][1] == errors[12][1] == [world - 1]
        assert (f"TP ranks disagree on the batch size B: ranks [{world - 1}] differ from rank 0: ranks "
                f"{list(range(world - 1))} hold B={b}; ranks [{world - 1}] hold B={other}") in errors[9][0]
        assert f"ranks [{world - 1}] hold invalid verify_lens" in errors[12][0]
        assert ("This rank: verify_lens must be a torch.Tensor, got list" in errors[12][0]) == (rank == world - 1)
        for step, agreed, bad in events:
            if bad is None:
                assert agreed == w.replicated_lens(step).tolist(), step  # the first rank's lens, every rank


@pytest.mark.parametrize("world", [2, 4])
def test_dp_ranks_agree_on_tier_and_idle_rank_layout_is_valid(launches, world):
    ranks = launches(world)
    per_rank = [r["dp"] for r in ranks]
    assert all(len(p) == STEPS[world]["dp"] for p in per_rank)
    tiers_seen = set()
    for step, steps in enumerate(zip(*per_rank)):
        rows = tuple(sum(s["lens"]) for s in steps)
        requests = tuple(len(s["lens"]) for s in steps)
        expect = round_up_to_tier(max(rows), w.TIERS)
        reason = f"DP rank {rows.index(max(rows))} has {max(rows)} verify rows"
        short = [r for r in range(world) if expect is not None and expect - rows[r] > (w.SLOTS - requests[r]) * w.WIDTH]
        if short:  # some rank's padding does not fit its ghost slots: everyone eager
            reason = f"DP rank {short[0]} needs {expect - rows[short[0]]} padding rows to reach tier {expect}"
            expect = None
        for s in steps:
            assert (s["tier"], s["rows"], s["requests"]) == (expect, rows, requests), f"step {step}"
            assert s["layout"]["tier"] == expect
            check_layout(s["layout"], w.WIDTH, w.SLOTS)
            if expect is None:
                assert reason in s["eager"] and s["layout"]["eager"] == s["eager"]
            else:
                assert s["layout"]["graph"] == expect
                assert s["forward"] == world * (world + 1) / 2
        assert world - 1 in steps[0]["idle"]
        idle = steps[-1]["layout"]
        assert idle["requests"] == 0 and idle["total"] == 0
        assert idle["graph"] == (expect if expect is not None else w.SLOTS)
        if expect is None:
            assert idle["slot_lens"] == [1] * w.SLOTS
        tiers_seen.add(expect)
    assert None in tiers_seen and len(tiers_seen) >= 3, f"scenario must cover eager and tiers: {tiers_seen}"


@pytest.mark.parametrize("world", [2, 4])
def test_rank_with_other_cost_table_is_refused_naming_both_hashes(launches, world):
    same, other = (t.fingerprint() for t in w.cost_tables())
    for rank, r in enumerate(launches(world)):
        msg = r["cost"]["message"]
        assert msg is not None and r["cost"]["ranks"] == [world - 1]
        assert f"ranks {list(range(world - 1))} have {same}" in msg
        assert f"ranks [{world - 1}] have {other}" in msg
        if rank == world - 1:
            assert f"rank {rank} is refused: its cost table {other} differs from {same} (rank 0)" in msg


@pytest.mark.parametrize("world", [2, 4])
def test_rank_with_any_other_planning_setting_is_refused_on_every_rank(launches, world):
    for rank, r in enumerate(launches(world)):
        for name in w.PLANNING_CHANGES:
            err = r["planning"][name]
            assert err is not None, f"rank {rank}: a last rank with another {name} was not refused"
            assert err["ranks"] == [world - 1]
            assert f"differ across ranks in {name} (" in err["message"]
            assert f"ranks [{world - 1}] have" in err["message"]
            assert ("is refused" if rank == world - 1 else "holds the group configuration") in err["message"]


@pytest.mark.parametrize("world", [2, 4])
def test_planner_with_parallel_config_agrees_and_matches_a_single_rank_planner(launches, world):
    ranks = [r["planner"] for r in launches(world)]
    solo = [VerifyPlanner(ScheduleConfig(gamma=w.GAMMA), w.cost_tables()[0],
                          PlannerSettings(lag=1, num_slots=16, tiers=w.TIERS, graph_slots=w.SLOTS))
            for _ in range(world // 2)]
    idle_steps = 0
    for step, steps in enumerate(zip(*ranks)):
        for replica, planner in enumerate(solo):
            plan = planner.plan(*w.planner_inputs(replica, step, 16))
            for peer in (2 * replica, 2 * replica + 1):
                assert steps[peer]["lens"] == plan.verify_lens.tolist(), f"step {step} rank {peer}"
        assert len({(s["tier"], s["rows"]) for s in steps}) == 1, f"step {step}: DP ranks disagree"
        for s in steps:
            check_layout(s["layout"], w.WIDTH, w.SLOTS)
            assert s["layout"]["tier"] == s["tier"]
            idle_steps += not s["lens"]
    assert idle_steps > 0 if world == 4 else idle_steps == 0


@functools.cache
def _estimator_reference(steps: int) -> list:
    """The estimator + planner scenario on one process without a group: what every TP rank must reproduce."""
    return w.estimator_steps(0, 1, None, steps, None)


def _per_step(ranks: list[dict], key: str, field: str) -> list[set]:
    return [{str(s[field]) for s in steps} for steps in zip(*(r[key] for r in ranks))]


@pytest.mark.parametrize("world", [2, 4])
def test_estimator_identical_survival_and_lens_on_every_rank_every_step(launches, world):
    ranks = launches(world)
    steps = STEPS[world]["estimator"]
    ref = _estimator_reference(steps)
    for r in ranks:
        assert [(s["survival"], s["parameters"], s["lens"]) for s in r["estimator"]] == [
            (s["survival"], s["parameters"], s["lens"]) for s in ref]
        assert not any(s["error"] or s["local_differs"] for s in r["estimator"])
    assert ref[-1]["refits"] == steps // w.EST["refit_every"]
    assert len({s["parameters"] for s in ref}) > steps // w.EST["refit_every"] // 2  # it keeps learning


@pytest.mark.parametrize("world", [2, 4])
def test_estimator_drift_is_caught_at_the_next_refit_on_every_rank(launches, world):
    """tp_mode='verify': a flipped label in the last rank's accumulator makes its refit differ; every rank
    raises in the same step, naming that rank, at every refit until the label leaves the window (then the
    fits agree and refits succeed again); survival never diverges across ranks."""
    ranks = launches(world)
    steps, drift, every = STEPS[world]["estimator_drift"], STEPS[world]["drift_step"], w.EST["refit_every"]
    first = (drift // every + 1) * every - 1  # the step whose observe runs the next refit
    for r in ranks:
        errors = {i: s["error"] for i, s in enumerate(r["estimator_drift"]) if s["error"]}
        assert len(errors) >= 3 and sorted(errors) == list(range(first, first + every * len(errors), every))
        assert max(errors) + every < steps, "the drifted label must leave the window within the run"
        assert r["estimator_drift"][-1]["refits"] > r["estimator_drift"][first]["refits"]  # agreed refits again
        for message, bad in errors.values():
            assert bad == [world - 1]
            assert f"TP ranks disagree on online estimator parameters: ranks [{world - 1}] differ from rank 0" in message
    for name in ("survival", "lens", "parameters"):
        assert all(len(v) == 1 for v in _per_step(ranks, "estimator_drift", name)), name


@pytest.mark.parametrize("world", [2, 4])
def test_first_rank_authority_keeps_a_drifted_rank_identical(launches, world):
    """tp_mode='broadcast': the drifted rank's own fits differ at every refit after the drift, yet every rank
    uses the first rank's parameters: identical survival and verify_lens at every step, no error."""
    ranks = launches(world)
    drift = STEPS[world]["drift_step"]
    for name in ("survival", "lens", "parameters"):
        assert all(len(v) == 1 for v in _per_step(ranks, "estimator_authority", name)), name
    ref = _estimator_reference(STEPS[world]["estimator_drift"])
    assert [s["survival"] for s in ranks[0]["estimator_authority"]] == [s["survival"] for s in ref]
    for rank, r in enumerate(ranks):
        assert not any(s["error"] for s in r["estimator_authority"])
        mismatched = sum(s["local_differs"] for s in r["estimator_authority"])
        if rank == world - 1:
            assert mismatched > 0 and not any(s["local_differs"] for s in r["estimator_authority"][:drift])
        else:
            assert mismatched == 0


@pytest.mark.parametrize("world", [2, 4])
def test_estimator_with_other_arguments_is_refused_at_construction(launches, world):
    for r in launches(world):
        assert r["estimator_config"]["ranks"] == [world - 1]
        assert "online estimator configuration fingerprints differ across ranks" in r["estimator_config"]["message"]


def test_launcher_turns_a_hang_into_a_timeout_error():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 1 still running after 3 s"):
        run_local_gloo(w.hang, 1, timeout=3.0)
    assert time.monotonic() - t0 < 10


@settings(max_examples=50)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=40))
def test_hash_matches_bigint_reference(lens):
    got = verify_lens_hash(torch.tensor(lens, dtype=torch.int64))
    assert got.dtype == torch.int64 and got.tolist() == _hash_reference(lens)


def test_hash_on_device_equals_cpu(device):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(1, 9, (257,), generator=g, dtype=torch.int32)
    assert verify_lens_hash(x.to(device)).cpu().tolist() == verify_lens_hash(x).tolist()


def test_hash_separates_every_single_change_and_batch_change():
    g = torch.Generator().manual_seed(11)
    seen = set()
    for _ in range(300):
        x = torch.randint(1, 9, (int(torch.randint(1, 64, (1,), generator=g)),), generator=g, dtype=torch.int32)
        base = tuple(verify_lens_hash(x).tolist())
        seen.add((tuple(x.tolist()), base))
        i = int(torch.randint(0, x.shape[0], (1,), generator=g))
        y = x.clone()
        y[i] = y[i] % 8 + 1
        assert tuple(verify_lens_hash(y).tolist()) != base
        assert tuple(verify_lens_hash(x[:-1]).tolist()) != base
        swapped = x.flip(0)
        if not torch.equal(swapped, x):
            assert tuple(verify_lens_hash(swapped).tolist()) != base
    assert len({h for _, h in seen}) == len({v for v, _ in seen})


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="'both'"):
        ParallelConfig(tp_mode="both")
    with pytest.raises(TypeError, match="float32"):
        verify_lens_hash(torch.ones(3))


def test_agreement_needs_an_initialized_process_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="not initialized"):
        TpAgreement(None, "verify")


def test_one_rank_group_is_a_no_op_and_validates(one_rank_group):
    lens = torch.tensor([3, 1, 8], dtype=torch.int32)
    for mode in ("verify", "broadcast"):
        assert torch.equal(TpAgreement(None, mode).agree(lens), lens)
    check_cost_table(None, "anything")
    with pytest.raises(ValueError, match="''"):
        check_cost_table(None, "")
    check_planning_config(None, {"tiers": "(8,)"})
    with pytest.raises(TypeError, match=r"config must map setting names to str values, got \{'lag': 1\}"):
        check_planning_config(None, {"lag": 1})
    with pytest.raises(ValueError, match="'sometimes'"):
        TpAgreement(None, "sometimes")
    with pytest.raises(ValueError, match="slots .* got 0"):
        DpTierAgreement(None, w.TIERS, 0, w.WIDTH)
    with pytest.raises(ValueError, match="width .* got 0"):
        DpTierAgreement(None, w.TIERS, w.SLOTS, 0)
    dp = DpTierAgreement(None, w.TIERS, w.SLOTS, w.WIDTH)
    with pytest.raises(ValueError, match="DP rank 0 has 9 requests"):
        dp.decide((9,), (9,))
    with pytest.raises(ValueError, match=r"one \(requests, rows\) per DP rank \(1\), got 2 and 2"):
        dp.decide((1, 2), (3, 4))


@settings(max_examples=40)
@given(
    b=st.integers(0, w.SLOTS - 1),
    tiers=st.sampled_from([(), (8,), (8, 16, 32), (4, 12, 40, 56)]),
    seed=st.integers(0, 2**16),
)
def test_one_rank_layouts_valid_for_any_batch(one_rank_group, b, tiers, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, w.WIDTH + 1, (b,), generator=g, dtype=torch.int32)
    layout, dec = DpTierAgreement(None, tiers, w.SLOTS, w.WIDTH).step(lens)
    d = w.layout_summary(layout)
    check_layout(d, w.WIDTH, w.SLOTS)
    total = int(lens.sum())
    tier = round_up_to_tier(total, tiers) if tiers else None
    if tier is not None and tier - total > (w.SLOTS - b) * w.WIDTH:
        tier = None  # the padding does not fit the ghost slots: eager
    assert dec.tier == layout.tier == tier and dec.rows == (total,) and dec.requests == (b,)
    assert dec.idle_ranks == ((0,) if b == 0 else ())
    if tier is not None:
        assert layout.graph_num_tokens == tier
    elif b == 0:
        assert d["slot_lens"] == [1] * w.SLOTS and layout.eager_reason == dec.eager_reason
    else:
        assert layout.graph_num_tokens == total
    assert (dec.eager_reason is not None) == (bool(tiers) and tier is None)
    assert layout.eager_reason == dec.eager_reason


def test_one_rank_estimator_agreement_keeps_the_bits(one_rank_group):
    agreement = EstimatorAgreement(ParallelConfig(tp_group=dist.group.WORLD), fingerprint="cfg")
    theta = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(agreement.agree(theta), theta)
    with pytest.raises(TypeError, match="parameters must be a 2-D float64 tensor, got torch.float32"):
        agreement.agree(theta.float())
    est = w.OnlineAcceptanceEstimator(3, parallel=ParallelConfig(tp_group=dist.group.WORLD))
    assert est.agreement is not None and torch.equal(est.refit(), est.prior)
