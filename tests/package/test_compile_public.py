"""The public verify-path API compiles: a function that calls `calibrated_survival`, `tau_curve`,
`choose_budget`, `allocate_verify_lens`, `expected_commit`, `RaggedVerifyLayout.from_verify_lens` or
`accept_greedy` runs under `torch.compile(fullgraph=True, dynamic=True)` and equals eager (DESIGN.md
section 3). Eager calls on the CPU take the numpy host paths; traced calls take the torch paths.

Each compiled function also returns `torch.compiler.is_compiling()`, a constant of its graph: True proves
the call ran the graph, not an eager fallback. Compiled functions are built once per backend and reused
across hypothesis examples (dynamic shapes; a new config or cost model is a guarded recompile).
Integer and boolean results must be identical; float results equal (floats summed in another order,
where the traced path does, to a few ulps).
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark import (
    BatchTerm,
    RaggedVerifyLayout,
    ScheduleConfig,
    StepsPerSecondTable,
    TieredCostModel,
    TierTerm,
    accept_greedy,
    allocate_verify_lens,
    calibrated_survival,
    choose_budget,
    expected_commit,
    greedy_budget,
    tau_curve,
)

CHEAP = ["eager", "aot_eager"]
FEW = settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
CONFIGS = [ScheduleConfig(gamma=5), ScheduleConfig(gamma=5, min_verify_len=2, max_verify_len=5),
           ScheduleConfig(gamma=3, survival_eps=0.3)]
TIERED = TieredCostModel(2e-3, BatchTerm([1, 16], [0.0, 1e-3]),
                         TierTerm([2, 5, 9, 16, 30, 64], [0.0, 0.3e-3, 1e-3, 1.2e-3, 4e-3, 9e-3]))
SPS = StepsPerSecondTable([1, 4, 9, 20, 40], [500.0, 420.0, 300.0, 150.0, 90.0])


@pytest.fixture(autouse=True)
def _room_for_recompiles():
    """Room for the guarded recompiles of a few configs and cost models (a fallback would fail the marker)."""
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


@functools.lru_cache(maxsize=None)
def compiled(fn, backend: str):
    """`fn` and the compile marker under torch.compile(fullgraph=True, dynamic=True), built once."""
    def marked(*args, **kwargs):
        return fn(*args, **kwargs), torch.compiler.is_compiling()
    return torch.compile(marked, fullgraph=True, dynamic=True, backend=backend)


def run_compiled(fn, backend, *args, **kwargs):
    out, traced = compiled(fn, backend)(*args, **kwargs)
    assert traced is True, "ran eagerly: the graph was not used"
    return out


def same(got, want) -> None:
    """Equal dtype, shape, device and values (NaN equal to NaN)."""
    assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, (got, want)
    assert got.device == want.device and torch.equal(got.isnan(), want.isnan()), (got, want)
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)), (got, want)


# ---------------------------------------------------------------- inputs (drawn, never all zeros)

@st.composite
def logits_case(draw, device):
    """Confidence logits [B, gamma] (odd B too) with NaN and +-inf entries, and STS temperatures."""
    cfg = draw(st.sampled_from(CONFIGS))
    b = draw(st.sampled_from([1, 3, 6, 11]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    z = torch.randn(b, cfg.gamma, generator=g) * 3 + 1
    for v, p in ((float("nan"), 0.08), (float("inf"), 0.04), (float("-inf"), 0.04)):
        z[torch.rand(b, cfg.gamma, generator=g) < p] = v
    temps = torch.rand(cfg.gamma, generator=g) * 1.5 + 0.3
    return cfg, z.to(device), temps.to(device)


@st.composite
def survival_case(draw, device):
    """Calibrated survival with ties (rounded to eighths above 0.4) and NaN entries handed in directly."""
    cfg, z, temps = draw(logits_case(device))
    s = calibrated_survival(z, temps)
    s = torch.where(s > 0.4, (s * 8).round() / 8, s)
    if draw(st.booleans()):
        s[0, -1] = float("nan")
    cost = draw(st.sampled_from([TIERED, SPS]))
    return cfg, s, cost


# ---------------------------------------------------------------- survival

@FEW
@given(data=st.data(), backend=st.sampled_from(CHEAP))
def test_calibrated_survival_compiles(data, backend, device):
    cfg, z, temps = data.draw(logits_case(device))
    for t in (temps, None):
        same(run_compiled(calibrated_survival, backend, z, t), calibrated_survival(z, t))


# ---------------------------------------------------------------- budget, tau, allocation, expected commit

def alike(got, want) -> None:
    """Equal dtype, shape and device; values equal to a few ulps (floats summed in another order), infinities
    where the other has them."""
    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor), (got, want)
    assert (got.dtype, got.shape, got.device) == (want.dtype, want.shape, want.device), (got, want)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def host(x: torch.Tensor) -> torch.Tensor:
    return x.cpu()


@FEW
@given(data=st.data(), backend=st.sampled_from(CHEAP), greedy=st.booleans())
def test_choose_budget_and_tau_curve_compile(data, backend, greedy, device):
    """The decision equals eager field by field: the same dtype, shape and values (0-d budget, rows, tau, step
    seconds, theta; curves over every budget B * C + 1); traced on the survival's device, eager on the host."""
    cfg, s, cost = data.draw(survival_case(device))
    fn = greedy_budget if greedy else choose_budget
    want, got = fn(s, cost, cfg), run_compiled(fn, backend, s, cost, cfg)
    assert got.base_rows == want.base_rows == s.shape[0] * cfg.floor
    assert got.budget.device == s.device and want.budget.device.type == "cpu"
    for name in ("budget", "rows", "num_candidates", "rows_curve"):
        same(host(getattr(got, name)), getattr(want, name))
    assert want.budget.dim() == 0 and want.budget.dtype == torch.int64
    for name in ("tau", "step_seconds", "theta", "tau_curve", "step_seconds_curve", "theta_curve"):
        alike(host(getattr(got, name)), getattr(want, name))
    n = int(want.num_candidates) + 1
    assert want.tau_curve.shape == (s.shape[0] * cfg.num_candidate_columns + 1,)  # static length
    assert bool((want.theta_curve[n:] == float("-inf")).all()) and bool((want.tau_curve[n:] == want.tau_curve[n - 1]).all())
    tau, eager = run_compiled(tau_curve, backend, s, cfg), tau_curve(s, cfg)
    alike(tau, eager), alike(host(eager), want.tau_curve)


@FEW
@given(data=st.data(), budget=st.integers(0, 40), backend=st.sampled_from(CHEAP))
def test_allocate_and_expected_commit_compile(data, budget, backend, device):
    cfg, s, _ = data.draw(survival_case(device))
    want = allocate_verify_lens(s, budget, cfg)
    same(run_compiled(allocate_verify_lens, backend, s, budget, cfg), want.to(s.device))
    got = run_compiled(expected_commit, backend, s, want.to(s.device), cfg)
    alike(got, expected_commit(s, want, cfg))
    assert got.dtype == torch.float64 and got.dim() == 0


def decide(survival, cost, cfg):
    """A step's decision written against the public API: the traced budget feeds the allocation."""
    decision = choose_budget(survival, cost, cfg)
    verify_lens = allocate_verify_lens(survival, decision.budget, cfg)
    return decision.budget, verify_lens, expected_commit(survival, verify_lens, cfg)


@FEW
@given(data=st.data(), backend=st.sampled_from(CHEAP))
def test_a_decision_written_against_the_public_api_compiles(data, backend, device):
    cfg, s, cost = data.draw(survival_case(device))
    budget, lens, tau = run_compiled(decide, backend, s, cost, cfg)
    want = decide(s, cost, cfg)
    same(host(budget), want[0]), same(lens, want[1].to(s.device)), alike(tau, want[2])


# ---------------------------------------------------------------- layout and accept

def _layout_fields(layout: RaggedVerifyLayout) -> dict:
    return {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}


def assert_same_layout(got: RaggedVerifyLayout, want: RaggedVerifyLayout) -> None:
    for name, value in _layout_fields(want).items():
        other = getattr(got, name)
        if isinstance(value, torch.Tensor):
            same(other, value)
        else:
            assert other == value, name


@st.composite
def lens_case(draw, device):
    b, w = draw(st.sampled_from([1, 3, 8])), draw(st.sampled_from([3, 6]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    vl = torch.randint(1, w + 1, (b,), generator=g, dtype=torch.int32).to(device)
    return vl, w


@FEW
@given(data=st.data(), pad=st.integers(0, 9), backend=st.sampled_from(CHEAP))
def test_layout_compiles(data, pad, backend, device):
    vl, w = data.draw(lens_case(device))
    total = int(vl.sum())
    tiers = (max(1, total - 1), total + pad, total + pad + 5)  # the first is too small: round up to the second
    slots = vl.numel() + 1 + pad
    want = RaggedVerifyLayout.from_verify_lens(vl, tiers, slots, width=w)
    got = run_compiled(RaggedVerifyLayout.from_verify_lens, backend, vl, tiers, slots, width=w, total_rows=total)
    assert_same_layout(got, want)
    graph_rows = total + pad
    want = RaggedVerifyLayout.from_verify_lens(vl, tiers, slots, width=w, graph_rows=graph_rows)
    got = run_compiled(RaggedVerifyLayout.from_verify_lens, backend, vl, tiers, slots, width=w, graph_rows=graph_rows)
    assert_same_layout(got, want)


def test_a_traced_layout_needs_its_row_count(device):
    vl = torch.tensor([2, 1, 3], dtype=torch.int32, device=device)
    with pytest.raises(Exception, match="total_rows=.*graph_rows="):
        torch.compile(lambda v: RaggedVerifyLayout.from_verify_lens(v, width=3), fullgraph=True, backend="eager")(vl)


@st.composite
def accept_case(draw, device):
    b, gamma, vocab = draw(st.sampled_from([1, 4, 7])), draw(st.sampled_from([2, 5])), draw(st.sampled_from([5, 33]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    vl = torch.randint(1, gamma + 2, (b,), generator=g, dtype=torch.int32)
    draft = torch.randint(0, vocab, (b, gamma), generator=g)
    target = torch.randn(b, gamma + 1, vocab, generator=g)
    keep = torch.rand(b, gamma, generator=g) < 0.7  # plant the drafts as argmax of a random prefix
    target[:, :gamma].scatter_add_(2, draft[..., None], keep[..., None].float() * 10)
    return draft.to(device), target.to(device), vl.to(device)


@FEW
@given(data=st.data(), packed=st.booleans(), backend=st.sampled_from(CHEAP))
def test_accept_greedy_compiles(data, packed, backend, device):
    draft, target, vl = data.draw(accept_case(device))
    layout = None
    if packed:
        layout = RaggedVerifyLayout.from_verify_lens(vl, width=draft.shape[1] + 1)
        target = layout.pack(target)
    want = accept_greedy(draft, target, vl, layout=layout)
    got = run_compiled(accept_greedy, backend, draft, target, vl, layout=layout)
    for f in dataclasses.fields(want):
        same(getattr(got, f.name), getattr(want, f.name))
    assert bool((want.correct_lens > 0).any()) or bool((vl == 1).all()) or draft.shape[0] < 4


@pytest.mark.parametrize("kind", ["steps", "additive"])
def test_a_fresh_cost_model_compiles_on_its_first_call(kind: str, device) -> None:
    """A cost model never called before: its lookup table exists from construction (a lazily built attribute
    takes a lock that torch.compile cannot enter)."""
    from dspark.cost import AdditiveCostModel, BatchTerm, RowTerm, StepsPerSecondTable

    cost = (StepsPerSecondTable([1, 8, 32], [400.0, 300.0, 120.0]) if kind == "steps" else
            AdditiveCostModel(0.002, BatchTerm([1, 16], [0.0, 0.001]), RowTerm([1, 32], [0.0005, 0.004])))
    cfg = ScheduleConfig(gamma=3)
    s = calibrated_survival(torch.tensor([[2.0, 1.0, -1.0], [0.5, 0.2, 3.0]], device=device))
    got = run_compiled(choose_budget, "eager", s, cost, cfg)
    assert int(got.budget) == choose_budget(s, cost, cfg).budget
