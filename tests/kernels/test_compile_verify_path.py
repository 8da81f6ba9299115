"""Every device-side computation of the verify path compiles with `torch.compile(fullgraph=True, dynamic=True)`
and equals eager (DESIGN.md section 3, torch.compile-first).

`fullgraph=True` turns any graph break into an error, so a passing compile proves there is none. Each case runs
under the cheap backends (`eager`: Dynamo's trace only; `aot_eager`: plus AOT autograd's functionalization)
on hypothesis-drawn shapes and values (8 per test: each recompiles from a fresh Dynamo cache), and once per module under the real inductor compiler. Integer results
must be identical; float results identical under the cheap backends and within a few ulps under inductor
(it may fuse float64 / float32 arithmetic differently).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark.kernels import accept as ka
from dspark.kernels import layout as kl
from dspark.kernels import ragged_attention as kra
from dspark.kernels import topk
from dspark.plan import budget as bu
from dspark.plan import budget_torch as bt
from dspark.plan import survival as su
from dspark.verify import accept as va
from dspark.verify import layout as vlay
from tests.kernels.test_attention import build_case

CHEAP = ["eager", "aot_eager"]
FIXTURE = settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def compiled(fn, backend: str):
    """`fn` under torch.compile(fullgraph=True, dynamic=True) with a fresh Dynamo cache."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=True, backend=backend)


def assert_same(got, want, exact: bool = True) -> None:
    """Equal structure; tensors bit-equal (ints always; floats when `exact`, else within a few ulps)."""
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and got.device == want.device
        if exact or not want.is_floating_point():
            assert torch.equal(got, want) or torch.equal(got.isnan(), want.isnan()) and torch.equal(
                got.nan_to_num(0.0), want.nan_to_num(0.0)), (got, want)
        else:
            torch.testing.assert_close(got, want, rtol=4 * torch.finfo(want.dtype).eps, atol=0, equal_nan=True)
        return
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w, exact)
        return
    assert got == want


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- inputs (drawn, never all zeros)

def survival_inputs(seed: int, b: int, gamma: int, device) -> tuple:
    g = _gen(seed)
    z = torch.randn(b, gamma, generator=g) * 4 + 1
    z[torch.rand(b, gamma, generator=g) < 0.1] = float("nan")
    z[torch.rand(b, gamma, generator=g) < 0.05] = float("-inf")
    temps = torch.rand(gamma, generator=g) * 2 + 0.25
    return z.to(device), temps.to(device)


def monotone(seed: int, b: int, gamma: int, device) -> torch.Tensor:
    """Calibrated survival with ties (rounded) and values below eps."""
    z, _ = survival_inputs(seed, b, gamma, device)
    s = su._survival(z, None)
    return torch.where(s > 0.5, (s * 8).round() / 8, s * 1e-6 * (seed % 3))


def lens(seed: int, b: int, w: int, device) -> torch.Tensor:
    return torch.randint(1, w + 1, (b,), generator=_gen(seed), dtype=torch.int32).to(device)


# ---------------------------------------------------------------- survival

@FIXTURE
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 9), gamma=st.integers(1, 7), temps=st.booleans(),
       backend=st.sampled_from(CHEAP))
def test_survival_compiles(seed, b, gamma, temps, backend, device):
    z, t = survival_inputs(seed, b, gamma, device)
    t = t if temps else None
    assert_same(compiled(su._survival, backend)(z, t), su._survival(z, t))
    assert_same(compiled(su.monotone_survival, backend)(z.nan_to_num(0.3)), su.monotone_survival(z.nan_to_num(0.3)))


# ---------------------------------------------------------------- budget

def _budget_case(seed, b, gamma, floor_gap, device):
    from dspark import AdditiveCostModel, BatchTerm, RowTerm, ScheduleConfig, TieredCostModel, TierTerm

    cfg = ScheduleConfig(gamma=gamma, min_verify_len=1 + floor_gap % gamma, max_verify_len=None)
    if seed % 2:  # a staircase: the greedy scan admits a tier's candidates together
        cost = TieredCostModel(2e-3, BatchTerm([1, 16], [0.0, 1e-3]),
                               TierTerm([2, 5, 9, 16, 30, 64], [0.0, 0.3e-3, 1e-3, 1.2e-3, 4e-3, 9e-3]))
    else:  # rows past the last probe are held flat: one run
        cost = AdditiveCostModel(2e-3, BatchTerm([1, 16], [0.0, 1e-3]), RowTerm([0, 8, 40], [0.0, 0.4e-3, 8e-3]))
    s = monotone(seed, b, gamma, device)
    seconds = bu.seconds_over_window(cost, b, cfg).to(device)
    return cfg, cost, s, seconds


@FIXTURE
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 9), gamma=st.integers(1, 6), gap=st.integers(0, 5),
       backend=st.sampled_from(CHEAP))
def test_budget_curves_compile_and_equal_the_host_budget(seed, b, gamma, gap, backend, device):
    cfg, cost, s, seconds = _budget_case(seed, b, gamma, gap, device)
    args = (s, seconds, cfg.floor, cfg.cap, cfg.survival_eps)
    eager = bt.theta_curves_torch(*args)
    assert_same(compiled(bt.theta_curves_torch, backend)(*args), eager)
    # the device budget is the host one (argmax and greedy scan), curves equal to rounding
    host, greedy = bu.choose_budget(s, cost, cfg), bu.greedy_budget(s, cost, cfg)
    assert int(eager.budget) == host.budget and int(eager.greedy) == greedy.budget
    n = int(eager.num_valid)
    assert int(host.num_candidates) == n
    torch.testing.assert_close(eager.tau.cpu(), host.tau_curve, rtol=1e-12, atol=0)
    torch.testing.assert_close(eager.theta.cpu(), host.theta_curve, rtol=1e-12, atol=0)
    assert bool((eager.theta[n + 1:] == float("-inf")).all())
    vl = lens(seed, b, cfg.width, device)
    assert_same(compiled(bt.expected_commit_torch, backend)(s, vl), bt.expected_commit_torch(s, vl))
    assert torch.equal(bt.expected_commit_torch(s, vl), bu.expected_commit(s, vl, cfg))


# ---------------------------------------------------------------- allocation (top-k reference)

@FIXTURE
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 9), gamma=st.integers(1, 6), budget=st.integers(0, 60),
       as_tensor=st.booleans(), backend=st.sampled_from(CHEAP))
def test_allocation_reference_compiles(seed, b, gamma, budget, as_tensor, backend, device):
    s = monotone(seed, b, gamma, device)
    k = torch.tensor(budget, device=device) if as_tensor else budget
    args = (s, k, 1, gamma + 1, 1e-6)
    want = topk.verify_lens_ref(*args)
    assert_same(compiled(topk.verify_lens_ref, backend)(*args), want)
    assert_same(want.cpu(), topk.verify_lens_host(s.cpu().numpy(), budget, 1, gamma + 1, 1e-6))


# ---------------------------------------------------------------- layout maps, pack / scatter

@FIXTURE
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 9), w=st.integers(1, 6), pad=st.integers(0, 13),
       backend=st.sampled_from(CHEAP))
def test_layout_maps_pack_scatter_compile(seed, b, w, pad, backend, device):
    vl = lens(seed, b, w, device)
    total = int(vl.sum())
    rows, ghosts = total + pad, -(-pad // w) + 1
    maps = vlay.slot_maps_torch(vl, rows, b + ghosts, w)
    assert_same(compiled(vlay.slot_maps_torch, backend)(vl, rows, b + ghosts, w), maps)
    # the device maps are the host-built layout's
    ref = vlay.RaggedVerifyLayout.from_verify_lens(vl.cpu(), [rows], b + ghosts, width=w)
    for got, name in zip(maps, ("slot_lens", "slot_qo_indptr", "seqused", "row_slot", "row_within")):
        assert torch.equal(got.cpu(), getattr(ref, name)), name
    strided = torch.randn(b, w, 3, generator=_gen(seed)).to(device)
    _, _, _, row_slot, row_within = maps
    packed = kl.pack_ref(strided, row_slot, row_within, total, -7.0)
    assert_same(compiled(kl.pack_ref, backend)(strided, row_slot, row_within, total, -7.0), packed)
    qo = kl.qo_indptr_ref(vl)
    assert_same(compiled(kl.scatter_ref, backend)(packed, qo, w, total, 5.0), kl.scatter_ref(packed, qo, w, total, 5.0))


# ---------------------------------------------------------------- accept

def _accept_case(seed, b, gamma, vocab, packed, device):
    g = _gen(seed)
    vl = lens(seed, b, gamma + 1, device)
    draft = torch.randint(0, vocab, (b, gamma), generator=g)
    target = torch.randn(b, gamma + 1, vocab, generator=g)
    # plant the draft as the argmax of a random prefix so acceptance lengths vary
    keep = torch.rand(b, gamma, generator=g) < 0.7
    target[:, :gamma].scatter_add_(2, draft[..., None], keep[..., None].float() * 10)
    draft, target = draft.to(device), target.to(device)
    layout = vlay.RaggedVerifyLayout.from_verify_lens(vl, width=gamma + 1) if packed else None
    if packed:
        target = layout.pack(target)
    return draft, target, vl, layout


def _fields(result: va.AcceptResult) -> tuple:
    return tuple(getattr(result, f.name) for f in dataclasses.fields(result))


@FIXTURE
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 7), gamma=st.integers(1, 5), vocab=st.integers(1, 40),
       packed=st.booleans(), backend=st.sampled_from(CHEAP))
def test_accept_compiles(seed, b, gamma, vocab, packed, backend, device):
    draft, target, vl, layout = _accept_case(seed, b, gamma, vocab, packed, device)

    def greedy(d, t, v):
        return _fields(va._accept_greedy(d, t, v, layout=layout))

    assert_same(compiled(greedy, backend)(draft, target, vl), _fields(va.accept_greedy(draft, target, vl, layout)))
    row_start = None if layout is None else layout.qo_indptr[:-1]
    probs = torch.softmax(target.float(), -1)
    q = torch.softmax(torch.randn(b, gamma, vocab, generator=_gen(seed + 1)), -1).to(device)
    u = torch.rand(b, gamma + 1, generator=_gen(seed + 2)).to(device)
    args = (draft, q, probs, vl, row_start, u)
    assert_same(compiled(ka.sampling_ref, backend)(*args), ka.sampling_ref(*args))


# ---------------------------------------------------------------- attention (the torch path)

def _attend(q, k_cache, v_cache, meta, sm_scale, out, lse):
    plan = kra.plan_torch_attention(meta, k_cache.shape[1], q.dtype)
    kra.ragged_attention_torch(q, k_cache, v_cache, meta, sm_scale, out, lse, plan)
    return out, lse


def _attention_inputs(seed, b, device):
    g = _gen(seed)
    vlens = torch.randint(1, 5, (b,), generator=g).tolist()
    prefixes = torch.randint(0, 20, (b,), generator=g).tolist()
    case = build_case(seed, vlens, prefixes, hkv=2, group=2, d=16, page_size=4, dtype=torch.float32,
                      device=device, padding=seed % 5)
    meta = case.attention().meta
    rows, hq, d = case.q.shape

    def outputs():  # poisoned before every run
        return torch.full((rows, hq, d), float("nan"), device=device), torch.full((rows, hq), 7.0, device=device)

    return case, meta, outputs


@FIXTURE
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 5), backend=st.sampled_from(CHEAP))
def test_attention_torch_path_compiles(seed, b, backend, device):
    case, meta, outputs = _attention_inputs(seed, b, device)
    args = (case.q, case.k_cache, case.v_cache, meta, 0.25)
    assert_same(compiled(_attend, backend)(*args, *outputs()), _attend(*args, *outputs()))


# ---------------------------------------------------------------- one real inductor compile per module

def _inductor_cases(device):
    """(module, fn, two argument tuples of different shapes): the second call reuses the dynamic graph."""
    _, _, s, seconds = _budget_case(3, 6, 5, 0, device)
    _, _, s2, seconds2 = _budget_case(4, 9, 5, 0, device)
    draft, target, vl, _ = _accept_case(5, 4, 5, 11, False, device)
    draft2, target2, vl2, _ = _accept_case(6, 7, 5, 13, False, device)
    case, meta, outputs = _attention_inputs(7, 3, device)
    case2, meta2, outputs2 = _attention_inputs(8, 4, device)
    return [
        ("survival", su._survival, survival_inputs(1, 5, 4, device), survival_inputs(2, 9, 4, device)),
        ("budget", bt.theta_curves_torch, (s, seconds, 1, 6, 1e-6), (s2, seconds2, 1, 6, 1e-6)),
        ("allocate", topk.verify_lens_ref, (s, torch.tensor(7, device=device), 1, 6, 1e-6),
         (s2, torch.tensor(11, device=device), 1, 6, 1e-6)),
        ("layout", vlay.slot_maps_torch, (lens(1, 5, 4, device), 24, 9, 4), (lens(2, 7, 4, device), 32, 11, 4)),
        ("accept", ka.greedy_ref, (draft, target, vl, None), (draft2, target2, vl2, None)),
        ("attention", _attend, (case.q, case.k_cache, case.v_cache, meta, 0.25, *outputs()),
         (case2.q, case2.k_cache, case2.v_cache, meta2, 0.25, *outputs2())),
    ]


@pytest.mark.parametrize("module", ["survival", "budget", "allocate", "layout", "accept", "attention"])
def test_inductor_compiles_each_module(module, device):
    _, fn, first, second = next(c for c in _inductor_cases(device) if c[0] == module)
    f = compiled(fn, "inductor")
    for args in (first, second):
        # the eager run gets fresh poisoned outputs where the function writes in place (attention)
        want = fn(*args[:-2], *(torch.full_like(a, float("nan")) for a in args[-2:])) if module == "attention" \
            else fn(*args)
        assert_same(f(*args), want, exact=False)
