import dataclasses
import json
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark import (
    AdditiveCostModel,
    BatchTerm,
    PlannerSettings,
    RowTerm,
    ScheduleConfig,
    VerifyPlanner,
    allocate_verify_lens,
    calibrated_survival,
    choose_budget,
    greedy_budget,
)
from dspark.cli import main as cli_main
from dspark.verify.layout import RaggedVerifyLayout, round_up_to_tier

GAMMA = 5


def cost(width=None) -> AdditiveCostModel:
    """Rows get steadily dearer: the argmax lands inside a tier, not at its top."""
    return AdditiveCostModel(2e-3, BatchTerm([1, 16], [0.0, 1e-3]), RowTerm([0, 8, 40], [0.0, 0.4e-3, 8e-3]),
                             width=width)


def logits(b, seed, device):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, GAMMA, generator=gen) * 2 + 1.5).to(device)


def ids(b):
    return torch.arange(b), torch.zeros(b, dtype=torch.int64)


def test_lag_one_budget_comes_from_the_previous_step(device):
    cfg = ScheduleConfig(gamma=GAMMA)
    planner = VerifyPlanner(cfg, cost(), PlannerSettings(lag=1, num_slots=8), device=device)
    slots, gens = ids(6)
    z0, z1, z2 = logits(6, 0, device), logits(6, 1, device), logits(6, 2, device)
    s0, s1 = calibrated_survival(z0), calibrated_survival(z1)

    first = planner.plan(z0, slots, gens)
    assert first.decision.budget == choose_budget(torch.ones(6, GAMMA), cost(), cfg).budget
    assert torch.equal(first.verify_lens, allocate_verify_lens(s0, first.decision.budget, cfg))

    second = planner.plan(z1, slots, gens)
    want = choose_budget(s0, cost(), cfg)
    assert (second.decision.budget, second.decision.tau) == (want.budget, want.tau)
    assert torch.equal(second.verify_lens, allocate_verify_lens(s1, second.decision.budget, cfg))
    assert torch.equal(second.survival, s1)

    gens_reused = gens.clone()
    gens_reused[0] = 1  # slot 0 now holds a new request: its lagged survival is all ones
    third = planner.plan(z2, slots, gens_reused)
    lagged = s1.clone()
    lagged[0] = 1.0
    assert third.decision.budget == choose_budget(lagged, cost(), cfg).budget
    assert third.decision.tau == pytest.approx(choose_budget(lagged, cost(), cfg).tau)


def test_lag_two_reads_two_steps_back(device):
    cfg = ScheduleConfig(gamma=GAMMA)
    planner = VerifyPlanner(cfg, cost(), PlannerSettings(lag=2, num_slots=4), device=device)
    slots, gens = ids(4)
    zs = [logits(4, seed, device) for seed in range(3)]
    plans = [planner.plan(z, slots, gens) for z in zs]
    want = choose_budget(calibrated_survival(zs[0]), cost(), cfg)
    assert plans[2].decision.budget == want.budget and plans[2].decision.tau == pytest.approx(want.tau)


def test_lag_zero_uses_the_greedy_scan_on_live_survival(device):
    cfg = ScheduleConfig(gamma=GAMMA)
    planner = VerifyPlanner(cfg, cost(), PlannerSettings(lag=0))
    z = logits(5, 3, device)
    plan = planner.plan(z, *ids(5))
    s = calibrated_survival(z)
    assert planner.ring is None
    assert plan.decision.budget == greedy_budget(s, cost(), cfg).budget
    assert torch.equal(plan.verify_lens, allocate_verify_lens(s, plan.decision.budget, cfg))


def hump() -> AdditiveCostModel:
    """One extra row costs as much as six (a tier edge, as graph tiers or this CPU's first verify row give)."""
    rows = RowTerm([0, 4, 5, 10, 40], [0.0, 0.0, 0.5, 0.52, 2.0])
    return AdditiveCostModel(1.0, BatchTerm([1, 16], [0.0, 0.0]), rows)


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 8), seed=st.integers(0, 2**31 - 1), shift=st.floats(-2.0, 4.0))
def test_lag_zero_live_argmax_takes_the_argmax_over_live_survival(b, seed, shift, device):
    cfg = ScheduleConfig(gamma=GAMMA)
    z = (torch.randn(b, GAMMA, generator=torch.Generator().manual_seed(seed)) * 2 + shift).to(device)
    s = calibrated_survival(z)
    for model in (cost(), hump()):
        plan = VerifyPlanner(cfg, model, PlannerSettings(lag=0, live_argmax=True)).plan(z, *ids(b))
        want = choose_budget(s, model, cfg)
        assert plan.decision.budget == want.budget and plan.decision.theta == pytest.approx(want.theta)
        assert torch.equal(plan.verify_lens.cpu(), allocate_verify_lens(s, want.budget, cfg).cpu())


@pytest.mark.parametrize("backend", ["auto", "torch"])  # torch: the traced decision, as on an accelerator
def test_live_argmax_crosses_the_row_where_the_scan_stops(backend, device, monkeypatch):
    monkeypatch.setenv("DSPARK_KERNEL_BACKEND", backend)
    cfg = ScheduleConfig(gamma=GAMMA)
    z = torch.logit(torch.tensor([[0.6, 0.95, 0.95, 0.95, 0.95]] * 4, dtype=torch.float64)).float().to(device)
    s = calibrated_survival(z)
    scan = VerifyPlanner(cfg, hump(), PlannerSettings(lag=0)).plan(z, *ids(4))
    free = VerifyPlanner(cfg, hump(), PlannerSettings(lag=0, live_argmax=True)).plan(z, *ids(4))
    # one more row (survival 0.6) costs 50 %: the scan stops at the roots; six rows cost 52 %, and pay
    assert scan.decision.budget == greedy_budget(s, hump(), cfg).budget == 0
    assert free.decision.budget == choose_budget(s, hump(), cfg).budget > 0
    assert free.decision.theta > scan.decision.theta


@pytest.mark.cpu_only(reason="settings validation, no tensors")
def test_live_argmax_needs_lag_zero_and_a_bool():
    with pytest.raises(ValueError, match="live_argmax=True .* lag=1"):
        PlannerSettings(lag=1, live_argmax=True)
    with pytest.raises(TypeError, match="live_argmax"):
        PlannerSettings(lag=0, live_argmax=1)
    a, b = (VerifyPlanner(ScheduleConfig(gamma=2), cost(), PlannerSettings(lag=0, live_argmax=live))
            for live in (True, False))
    assert a.planning_config()["live_argmax"] != b.planning_config()["live_argmax"]  # TP / DP ranks compare it


@pytest.mark.cpu_only(reason="the host plan path and its layout cache live on the CPU")
@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 4), seed=st.integers(0, 2**31 - 1), steps=st.integers(2, 12),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_a_reused_host_layout_equals_the_layout_built_afresh(b, seed, steps, dtype):
    """The planner keeps the layouts it built on the host and hands an earlier step's back when the verify lengths
    repeat: every step's layout equals one built from its lengths alone, and equal lengths share one object."""
    tiers = (1, 2, 4, 6, 8, 12, 16, 24)
    planner = VerifyPlanner(ScheduleConfig(gamma=GAMMA), cost(), PlannerSettings(lag=0, tiers=tiers, graph_slots=b + 8),
                            temperatures=[1.3, 0.7, 1.0, 2.0, 0.9])
    gen = torch.Generator().manual_seed(seed)
    seen = {}
    for _ in range(steps):
        z = (torch.randn(b, GAMMA, generator=gen) * 3 + 1.0).to(dtype)
        plan = planner.plan(z, *ids(b))
        fresh = RaggedVerifyLayout.from_verify_lens(plan.verify_lens, tiers, b + 8, width=GAMMA + 1)
        for f in dataclasses.fields(fresh):
            mine, want = getattr(plan.layout, f.name), getattr(fresh, f.name)
            assert torch.equal(mine, want) if isinstance(want, torch.Tensor) else mine == want, f.name
        key = tuple(plan.verify_lens.tolist())
        assert seen.setdefault(key, plan.layout) is plan.layout
        # the survival read on the host is the torch path's, whatever the logits' float type
        assert torch.equal(plan.survival, calibrated_survival(z, [1.3, 0.7, 1.0, 2.0, 0.9]))


@settings(max_examples=40)
@given(b=st.integers(1, 12), seed=st.integers(0, 2**31 - 1), scale=st.floats(0.1, 8.0),
       special=st.sampled_from([None, math.inf, -math.inf, math.nan]), live_argmax=st.booleans(),
       model=st.sampled_from([cost, hump]))
def test_lag_zero_host_path_equals_the_torch_path(b, seed, scale, special, live_argmax, model, device):
    """On the CPU the planner shares one numpy copy of the live survival between budget and allocation
    (no running minimum: calibrated survival is already monotone); the torch path on the device must agree
    exactly, with the scan and with the live argmax."""
    cfg = ScheduleConfig(gamma=GAMMA)
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(b, GAMMA, generator=gen) * scale + 1.0
    if special is not None:
        z[0, 1] = special
    with pytest.MonkeyPatch.context() as mp:
        plans = []
        for backend, on in (("auto", z), ("torch", z.to(device))):
            mp.setenv("DSPARK_KERNEL_BACKEND", backend)
            planner = VerifyPlanner(cfg, model(), PlannerSettings(lag=0, live_argmax=live_argmax),
                                    temperatures=[1.3, 0.7, 1.0, 2.0, 0.9])
            plans.append(planner.plan(on, *ids(b)))
    host, ref = plans
    assert ref.verify_lens.device == z.to(device).device
    assert host.decision.budget == ref.decision.budget and host.decision.theta == ref.decision.theta
    assert torch.equal(host.verify_lens, ref.verify_lens.cpu()) and torch.equal(host.survival, ref.survival.cpu())
    assert torch.equal(host.layout.row_slot, ref.layout.row_slot.cpu())


def test_temperatures_reach_the_live_survival(device):
    cfg = ScheduleConfig(gamma=GAMMA)
    temps = [0.5, 1.0, 2.0, 1.5, 0.8]
    plan = VerifyPlanner(cfg, cost(), PlannerSettings(lag=0), temperatures=temps).plan(logits(3, 4, device), *ids(3))
    assert torch.equal(plan.survival, calibrated_survival(logits(3, 4, device), temps))


@settings(max_examples=20)
@given(b=st.integers(1, 9), seed=st.integers(0, 2**31 - 1), lag=st.integers(0, 1),
       tiers=st.sampled_from([(8, 16, 24, 32, 48), (4, 12), (64,), (10, 11, 12, 13, 14, 15, 16)]))
def test_tier_fill_fills_the_paid_tier_and_never_crosses_it(b, seed, lag, tiers, device):
    cfg = ScheduleConfig(gamma=GAMMA, min_verify_len=2, max_verify_len=5)
    planner = VerifyPlanner(cfg, cost(), PlannerSettings(lag=lag, num_slots=16, tiers=tiers, graph_slots=24),
                            device=device)
    slots, gens = ids(b)
    planner.plan(logits(b, seed + 1, device), slots, gens)
    plan = planner.plan(logits(b, seed, device), slots, gens)
    decided_rows = b * cfg.floor + plan.decision.budget
    tier = round_up_to_tier(decided_rows, tiers)
    plain = allocate_verify_lens(plan.survival, plan.decision.budget, cfg)
    assert bool((plan.verify_lens >= plain).all())
    assert torch.equal(plan.verify_lens, allocate_verify_lens(plan.survival, plan.tier_budget, cfg))
    total = int(plan.verify_lens.sum())
    assert plan.layout.total_rows == total
    assert total == b * cfg.floor + plan.budget  # the executed budget: rows actually allocated
    if tier is None:
        assert plan.budget == plan.tier_budget == plan.decision.budget and total <= decided_rows
        assert (plan.layout.tier is None) == (plan.layout.eager_reason is not None)
    else:
        assert plan.tier_budget == tier - b * cfg.floor
        assert total <= tier and plan.layout.graph_num_tokens == plan.layout.tier <= tier
        n_valid = int((plan.survival[:, cfg.floor - 1: cfg.cap - 1] >= cfg.survival_eps).sum())
        assert plan.budget == min(plan.tier_budget, n_valid)


def test_tier_fill_example(device):
    cfg = ScheduleConfig(gamma=GAMMA)
    cliff = AdditiveCostModel(1e-3, BatchTerm([1], [0.0]), RowTerm([0, 10, 11, 40], [0.0, 0.2e-3, 10e-3, 12e-3]))
    # lag 1 (the argmax over the ring's all-ones rows of new requests): the lag-0 scan's unit is a whole
    # tier, so it never stops inside one
    planner = VerifyPlanner(cfg, cliff, PlannerSettings(lag=1, num_slots=4, tiers=(16, 32), graph_slots=8))
    z = torch.full((4, GAMMA), 6.0, device=device)  # confident: every candidate is valid
    plan = planner.plan(z, *ids(4))
    assert plan.decision.budget == 6 and plan.decision.rows == 10 and plan.budget == plan.tier_budget == 12
    assert int(plan.verify_lens.sum()) == 16 and plan.layout.tier == 16 and plan.layout.num_padding_rows == 0
    assert plan.layout.num_slots == 8


def test_budget_reports_the_rows_executed_when_candidates_run_out(device):
    """B = 1, gamma = 2, tier 64: the tier offers 63 extra rows, but only 2 drafts exist to fill them."""
    cfg = ScheduleConfig(gamma=2)
    flat = AdditiveCostModel(1e-3, BatchTerm([1], [0.0]), RowTerm([0, 64], [0.0, 1e-4]))
    planner = VerifyPlanner(cfg, flat, PlannerSettings(lag=0, tiers=(64,)))
    plan = planner.plan(torch.full((1, 2), 4.0, device=device), *ids(1))
    assert plan.verify_lens.tolist() == [3] and plan.layout.tier == 64
    assert plan.budget == 2 and plan.tier_budget == 63


def test_nan_logits_and_empty_batch(device):
    cfg = ScheduleConfig(gamma=GAMMA)
    planner = VerifyPlanner(cfg, cost(), PlannerSettings(lag=1, num_slots=4), device=device)
    z = torch.full((2, GAMMA), 5.0, device=device)
    z[0, 1] = math.nan
    z[1, 0] = -math.inf
    plan = planner.plan(z, *ids(2))
    assert int(plan.verify_lens[0]) <= 2 and int(plan.verify_lens[1]) == 1
    empty = planner.plan(torch.zeros(0, GAMMA, device=device), *ids(0))
    assert empty.verify_lens.shape == (0,) and empty.decision.budget == 0


@pytest.mark.parametrize("kwargs, exc, needle", [
    ({"cost_model": cost(width=9)}, ValueError, "W=9"),
    ({"lag": -1}, ValueError, "-1"),
    ({"lag": 1.5}, ValueError, "1.5"),
    ({"temperatures": [1.0, 0.0, 1.0, 1.0, 1.0]}, ValueError, r"temperatures\[1\] = 0.0"),
    ({"graph_slots": 0}, ValueError, "graph_slots"),
    ({"tiers": (16, 8)}, ValueError, r"\[16, 8\]"),
    ({"cost_model": "table.json"}, TypeError, "str"),
    ({"cfg": {"gamma": 5}}, TypeError, "dict"),
    ({"num_slots": 0}, ValueError, "num_slots"),
])
def test_bad_planner_arguments(kwargs, exc, needle, device):
    args = {"cfg": ScheduleConfig(gamma=GAMMA), "cost_model": cost(), "device": device, **kwargs}
    with pytest.raises(exc, match=needle):  # the settings check theirs when built, the planner the rest
        planning = PlannerSettings(**{f.name: args.pop(f.name) for f in dataclasses.fields(PlannerSettings)
                                      if f.name in args})
        VerifyPlanner(**args, settings=planning)


def test_bad_plan_inputs(device):
    planner = VerifyPlanner(ScheduleConfig(gamma=GAMMA), cost(), PlannerSettings(lag=1, num_slots=4), device=device)
    with pytest.raises(ValueError, match=r"gamma=5.*\(2, 4\)"):
        planner.plan(torch.zeros(2, 4, device=device), *ids(2))
    with pytest.raises(ValueError, match="slots must lie in"):
        planner.plan(torch.zeros(2, GAMMA, device=device), torch.tensor([0, 9]), torch.zeros(2, dtype=torch.int64))
    # slots / generations of another batch size are named (the ring used to blame the survival)
    with pytest.raises(ValueError, match=r"slots must be \[B=2\] .* got shape \(3,\)"):
        planner.plan(torch.zeros(2, GAMMA, device=device), *ids(3))
    with pytest.raises(ValueError, match=r"generations must be \[B=2\] .* got shape \(1,\)"):
        planner.plan(torch.zeros(2, GAMMA, device=device), ids(2)[0], torch.zeros(1, dtype=torch.int64))


def test_plan_demo_writes_json_and_png(tmp_path, capsys, device):
    assert cli_main(["plan-demo", "--device", device.type, "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "planner_demo.json").read_text())
    assert (tmp_path / "planner_demo.png").stat().st_size > 1000
    assert record["theta_curve"][record["budget"]] == max(record["theta_curve"])
    assert "ILLUSTRATIVE" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.cpu_only(reason="an unknown device name is refused before any tensor exists")
def test_demo_reports_an_unusable_device(tmp_path, capsys):
    assert cli_main(["demo", "--device", "nosuchdevice", "--out", str(tmp_path)]) == 2
    assert "nosuchdevice" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.cuda
def test_host_syncs_on_cuda(device):
    """The allocation never waits for the device; the budget waits once (its survival copy)."""
    cfg = ScheduleConfig(gamma=GAMMA)
    s = calibrated_survival(logits(64, 0, device))
    allocate_verify_lens(s, 10, cfg)
    choose_budget(s, cost(), cfg)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            allocate_verify_lens(s, 100, cfg)
            in_allocation = _syncs(seen)
            choose_budget(s, cost(), cfg)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert in_allocation == 0 and _syncs(seen) - in_allocation <= 1, [str(w.message) for w in seen]


def _syncs(seen: list) -> int:
    """Synchronizing operations among recorded warnings (not the debug mode's own prototype notice)."""
    return sum("synchronizing CUDA operation" in str(w.message) for w in seen)


@pytest.mark.parametrize("b", [1, 7, 64])
def test_host_planned_step_equals_the_triton_path(b, monkeypatch, device):
    """A small batch is planned on the host (one survival copy) and its layout copied to the device; it
    must equal the device (Triton, interpreted on the CPU) path field by field."""
    cfg = ScheduleConfig(gamma=GAMMA)
    z = logits(b, 5, device)
    host = VerifyPlanner(cfg, cost(), PlannerSettings(lag=0)).plan(z, *ids(b))
    monkeypatch.setenv("DSPARK_KERNEL_BACKEND", "triton")
    ref = VerifyPlanner(cfg, cost(), PlannerSettings(lag=0)).plan(z, *ids(b))
    assert host.decision.budget == ref.decision.budget
    for name in ("verify_lens", "qo_indptr", "slot_lens", "slot_qo_indptr", "seqused", "row_slot", "row_within"):
        a, r = getattr(host.layout, name), getattr(ref.layout, name)
        assert a.device == r.device and a.dtype == r.dtype and torch.equal(a, r), name
    assert host.verify_lens.device == z.device and torch.equal(host.verify_lens, ref.verify_lens)


@pytest.mark.parametrize("entry", ["choose_budget", "greedy_budget", "VerifyPlanner"])
def test_every_entry_refuses_a_cost_model_profiled_at_another_width(entry, device):
    """One rule wherever a cost model meets a config: a table profiled at W=8 does not plan W=6."""
    cfg, table = ScheduleConfig(gamma=GAMMA), cost(width=8)
    run = {"choose_budget": lambda: choose_budget(calibrated_survival(logits(3, 0, device)), table, cfg),
           "greedy_budget": lambda: greedy_budget(calibrated_survival(logits(3, 0, device)), table, cfg),
           "VerifyPlanner": lambda: VerifyPlanner(cfg, table, PlannerSettings(lag=0))}[entry]
    with pytest.raises(ValueError, match=r"profiled for W=8, this run has W=6 \(gamma=5\): re-profile the "
                                         r"verify step at gamma=5 .* or run with gamma=7"):
        run()
    assert choose_budget(calibrated_survival(logits(3, 0, device)), cost(width=6), cfg).budget >= 0


def test_planner_refuses_a_cost_model_profiled_on_another_platform(device):
    other = "npu" if device.type != "npu" else "cuda"
    cfg = ScheduleConfig(gamma=GAMMA)
    foreign = AdditiveCostModel(2e-3, BatchTerm([1], [0.0]), RowTerm([0, 40], [0.0, 8e-3]), platform=f"x86_64-{other}")
    planner = VerifyPlanner(cfg, foreign, PlannerSettings(lag=0))
    with pytest.raises(ValueError, match=rf"platform 'x86_64-{other}', this run is on '{device.type}': re-profile"):
        planner.plan(logits(2, 0, device), *ids(2))
    for platform in (device.type, f"x86_64-{device.type}", "unknown"):
        native = AdditiveCostModel(2e-3, BatchTerm([1], [0.0]), RowTerm([0, 40], [0.0, 8e-3]), platform=platform)
        planner = VerifyPlanner(cfg, native, PlannerSettings(lag=0))
        assert planner.plan(logits(2, 0, device), *ids(2)).verify_lens.shape == (2,)
