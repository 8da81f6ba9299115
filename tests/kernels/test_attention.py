"""Ragged verify attention over a paged KV cache: kernel == float64 reference, compact == static, graph replay."""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dspark import AttentionShape, RaggedVerifyAttention, RaggedVerifyLayout, verify_attention, write_kv
from dspark.kernels import dispatch
from dspark.kernels import ragged_attention as RA
from dspark.kernels._triton import jit, tl
from dspark.kernels.kv_write import write_kv_ref
from dspark.kernels.ragged_attention import ragged_attention_ref

NAN = float("nan")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 3e-3}
POLICIES = [("work", None), ("cores", 3)]


def fixture_settings(max_examples: int) -> settings:
    """Hypothesis settings for tests that also take the (constant) function-scoped backend fixture."""
    return settings(max_examples=max_examples, suppress_health_check=[
        HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class Case:
    layout: RaggedVerifyLayout
    prefix: torch.Tensor      # [B]
    table: torch.Tensor       # [B, P] int32
    k_cache: torch.Tensor     # non-contiguous, NaN everywhere except the committed prefixes
    v_cache: torch.Tensor
    q: torch.Tensor           # [rows, Hq, D] non-contiguous, NaN in padding rows
    k_new: torch.Tensor       # [rows, Hkv, D] verify rows' K/V, NaN in padding rows
    v_new: torch.Tensor

    def attention(self, **kwargs) -> RaggedVerifyAttention:
        hq, d = self.q.shape[1:]
        shape = AttentionShape(self.layout.graph_num_tokens, self.layout.num_slots, self.table.shape[1], hq,
                               self.k_cache.shape[2], d, self.k_cache.shape[1], num_pages=self.k_cache.shape[0],
                               **kwargs)
        attn = RaggedVerifyAttention(shape, self.q.device, self.q.dtype)
        attn.plan(self.layout, self.prefix, self.table)
        return attn


def _poisoned_cache(num_pages, page_size, hkv, d, dtype, device):
    """NaN-filled [pages, page_size, Hkv, D] view with non-contiguous strides (head-major, padded D)."""
    return torch.full((num_pages, hkv, page_size, d + 3), NAN, dtype=dtype).to(device)[..., :d].transpose(1, 2)


def build_case(seed, vlens, prefixes, *, hkv, group, d, page_size, dtype, device, padding=0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    b = len(vlens)
    total = sum(vlens)
    width = max(vlens + [1])
    ghosts = -(-padding // width) + 1 if padding else 0  # padding spread over ghost slots, plus an empty one
    layout = RaggedVerifyLayout.from_verify_lens(
        torch.tensor(vlens, dtype=torch.int32, device=device), tiers=[total + padding] if padding else None,
        graph_slots=b + ghosts, width=width)
    kv = [p + v for p, v in zip(prefixes, vlens)]
    need = [math.ceil(k / page_size) for k in kv]
    cols = max(need + [1]) + 1
    num_pages = sum(need) + 2
    perm = torch.randperm(num_pages, generator=gen, dtype=torch.int32)
    # unused block-table columns point at a NaN page (even seeds) or far outside the cache (odd seeds)
    table = torch.full((b, cols), int(perm[-1]) if seed % 2 == 0 else 2**30, dtype=torch.int32)
    at = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[at:at + n]
        at += n
    kc = _poisoned_cache(num_pages, page_size, hkv, d, dtype, device)
    vc = _poisoned_cache(num_pages, page_size, hkv, d, dtype, device)
    req = torch.repeat_interleave(torch.arange(b), torch.tensor(prefixes, dtype=torch.int64))
    pos = torch.cat([torch.arange(p) for p in prefixes]) if b else torch.zeros(0, dtype=torch.int64)
    slots = (table[req, pos // page_size].long() * page_size + pos % page_size).to(device)
    rand = lambda *s: torch.randn(*s, generator=gen).to(dtype).to(device)  # noqa: E731
    write_kv_ref(rand(len(pos), hkv, d), rand(len(pos), hkv, d), kc, vc, slots)
    rows = layout.graph_num_tokens
    q = rand(hkv * group, rows, d).transpose(0, 1)
    k_new, v_new = rand(rows, hkv, d), rand(rows, hkv, d)
    for t in (q, k_new, v_new):
        t[total:] = NAN
    return Case(layout, torch.tensor(prefixes, dtype=torch.int64), table, kc, vc, q, k_new, v_new)


@contextlib.contextmanager
def backend(name):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(dispatch.BACKEND_ENV, name)
        yield


def run_and_check(case: Case, *, policy=("work", None), lse=True, attn=None, out=None):
    """Write the verify K/V, run attention (NaN-poisoned out/lse), compare with the float64 reference."""
    attn = attn if attn is not None else case.attention()
    write_kv(case.k_new, case.v_new, case.k_cache, case.v_cache, attn.kv_slots)
    out = out if out is not None else torch.full_like(case.q, NAN)
    out.fill_(NAN)
    lse_t = torch.full(case.q.shape[:2], NAN, device=case.q.device) if lse else None
    with dispatch.launch_policy(*policy):
        attn.run(case.q, case.k_cache, case.v_cache, out=out, lse=lse_t)
    ref, ref_lse = ragged_attention_ref(case.q, case.k_cache, case.v_cache, attn.meta, attn.sm_scale)
    tol = TOL[case.q.dtype]
    total = case.layout.total_rows
    assert not out.isnan().any(), "NaN leaked into the output"
    torch.testing.assert_close(out[:total].double(), ref[:total], rtol=tol, atol=tol)
    assert bool((out[total:] == 0).all()), "padding rows must be zero"
    if lse:
        torch.testing.assert_close(lse_t[:total].double(), ref_lse[:total], rtol=tol, atol=tol)
        assert bool((lse_t[total:] == float("-inf")).all())
    return out


shapes = dict(
    hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 4, 8]), d=st.sampled_from([4, 8, 16]),
    page_size=st.sampled_from([1, 3, 7, 16, 64]), dtype=st.sampled_from(list(TOL)),
)


@fixture_settings(10)
@given(data=st.data(), b=st.integers(1, 4), padding=st.integers(0, 6), policy=st.sampled_from(POLICIES),
       splits=st.sampled_from([1, 3, 16]), seed=st.integers(0, 2**16), **shapes)
def test_triton_matches_reference(data, b, padding, policy, splits, seed, hkv, group, d, page_size, dtype, device,
                                  triton_backend):
    vlens = data.draw(st.lists(st.integers(1, 17), min_size=b, max_size=b))
    prefixes = data.draw(st.lists(st.integers(0, 2000), min_size=b, max_size=b))
    case = build_case(seed, vlens, prefixes, hkv=hkv, group=group, d=d, page_size=page_size, dtype=dtype,
                      device=device, padding=padding)
    run_and_check(case, policy=policy, attn=case.attention(num_kv_splits=splits))


@fixture_settings(2)
@example(b=64, seed=0, group=4)
@given(b=st.integers(1, 64), seed=st.integers(0, 2**16), group=st.sampled_from([1, 4]))
def test_triton_large_batch(b, seed, group, device, triton_backend):
    gen = torch.Generator().manual_seed(seed)
    vlens = torch.randint(1, 18, (b,), generator=gen).tolist()
    prefixes = torch.randint(0, 41, (b,), generator=gen).tolist()
    case = build_case(seed, vlens, prefixes, hkv=1, group=group, d=8, page_size=5, dtype=torch.float32,
                      device=device, padding=3)
    run_and_check(case, policy=("cores", 3))


@settings(max_examples=10)
@given(data=st.data(), b=st.integers(1, 12), padding=st.integers(0, 6), seed=st.integers(0, 2**16), **shapes)
def test_torch_path_matches_reference(data, b, padding, seed, hkv, group, d, page_size, dtype, device):
    vlens = data.draw(st.lists(st.integers(1, 17), min_size=b, max_size=b))
    prefixes = data.draw(st.lists(st.integers(0, 2000), min_size=b, max_size=b))
    case = build_case(seed, vlens, prefixes, hkv=hkv, group=group, d=d, page_size=page_size, dtype=dtype,
                      device=device, padding=padding)
    with backend("torch"):
        run_and_check(case)


@settings(max_examples=6)
@given(b=st.integers(1, 4), padding=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_torch_plan_leaves_ghost_slots_out(b, padding, seed, device):
    """A tier-padded layout's ghost slots hold padding rows only: the torch path attends over the B request
    slots (its padded SDPA cost grows with the slots it covers) and still zeroes every padding row."""
    case = build_case(seed, [3] * b, [5] * b, hkv=2, group=2, d=8, page_size=4, dtype=torch.float32,
                      device=device, padding=padding)
    assert case.layout.num_slots > b
    with backend("torch"):
        attn = case.attention()
        assert sum(group.mask.shape[0] for group in attn._torch_plan.groups) == b
        run_and_check(case, attn=attn)


@pytest.mark.cpu_only(reason="the host grouping rule of the torch path's plan")
@settings(max_examples=30)
@given(lens=st.lists(st.integers(0, 300), max_size=40), short=st.integers(1, 16))
def test_slot_groups_cover_every_slot_once_and_at_most_double_their_rows(lens, short):
    """Each slot sits in one group; padded to its group's longest query a slot at most doubles its rows, or
    that longest query has at most `short` rows; groups hold query lengths in descending order."""
    groups = RA.group_slots(lens, short)
    assert sorted(s for g in groups for s in g) == list(range(len(lens)))
    for g in groups:
        longest = max(lens[s] for s in g)
        assert longest <= short or all(2 * lens[s] >= longest for s in g), (g, [lens[s] for s in g])
    flat = [lens[s] for g in groups for s in g]
    assert flat == sorted(flat, reverse=True)


@pytest.mark.parametrize("extra", [[], [3, 5]])
def test_torch_path_pads_a_long_prompt_in_its_own_group(extra, device):
    """A 100-row prompt beside short verify segments (a folded prefill) is attended in a group of its own:
    the short slots pad to their own longest query, not to the prompt's 100 rows, and the rows equal the
    float64 reference."""
    vlens = [2, 4, 100, 1, 3, 4, 1, 2] + extra
    case = build_case(5, vlens, [40, 7, 0, 90, 3, 12, 60, 1] + [9] * len(extra), hkv=2, group=2, d=8,
                      page_size=4, dtype=torch.float32, device=device, padding=3)
    with backend("torch"):
        attn = case.attention()
        shapes = [tuple(g.mask.shape) for g in attn._torch_plan.groups]
        assert shapes[0] == (1, 1, 100, 100)                          # the prompt: its rows, its kv
        assert [g.slots.tolist() for g in attn._torch_plan.groups][0] == [2]
        assert all(shape[2] <= 5 for shape in shapes[1:]) and sum(shape[0] for shape in shapes) == len(vlens)
        run_and_check(case, attn=attn)


@pytest.mark.parametrize("name", ["triton", "torch"])
@pytest.mark.parametrize("padding", [0, 5])
def test_empty_batch(name, padding, device):
    case = build_case(0, [], [], hkv=2, group=2, d=8, page_size=4, dtype=torch.float32, device=device,
                      padding=padding)
    with backend(name):
        run_and_check(case)


@pytest.mark.parametrize("name", ["triton", "torch"])
@settings(max_examples=8)
@given(data=st.data(), b=st.integers(1, 6), w=st.integers(2, 9), seed=st.integers(0, 2**16),
       page_size=st.sampled_from([1, 4, 5]))
def test_compact_scattered_back_equals_static(name, data, b, w, seed, page_size, device):
    """Each request verifies only its first verify_len rows; those rows equal the static (all-W) run."""
    vlens = data.draw(st.lists(st.integers(1, w), min_size=b, max_size=b))
    prefixes = data.draw(st.lists(st.integers(0, 300), min_size=b, max_size=b))
    static = build_case(seed, [w] * b, prefixes, hkv=2, group=2, d=8, page_size=page_size,
                        dtype=torch.float32, device=device)
    compact = build_case(seed, vlens, prefixes, hkv=2, group=2, d=8, page_size=page_size,
                         dtype=torch.float32, device=device, padding=2)
    compact.table = static.table
    compact.k_cache, compact.v_cache = static.k_cache.clone(), static.v_cache.clone()
    for src_name in ("q", "k_new", "v_new"):
        strided = getattr(static, src_name).reshape(b, w, *getattr(static, src_name).shape[1:])
        getattr(compact, src_name).copy_(compact.layout.pack(strided, fill=NAN))
    with backend(name):
        out_static = run_and_check(static)
        out_compact = run_and_check(compact)
    back = compact.layout.scatter(out_compact, width=w, fill=NAN)
    real = torch.arange(w, device=device)[None, :] < compact.layout.verify_lens[:, None]
    torch.testing.assert_close(back[real], out_static.reshape(b, w, *out_static.shape[1:])[real],
                               rtol=1e-6, atol=1e-6)


def _two_layouts_same_tier(device, dtype, splits=None, padding_a=4, padding_b=1):
    a = build_case(1, [3, 1, 5], [9, 0, 40], hkv=2, group=4, d=16, page_size=3, dtype=dtype, device=device,
                   padding=padding_a)
    b = build_case(2, [2, 7, 1, 2], [33, 5, 0, 17], hkv=2, group=4, d=16, page_size=3, dtype=dtype,
                   device=device, padding=padding_b)
    assert a.layout.graph_num_tokens == b.layout.graph_num_tokens == 13
    # one cache, one planner, one query buffer; per-case K/V prefixes go into disjoint halves of the pages
    b.table += a.k_cache.shape[0]
    k_cache = torch.cat([a.k_cache, b.k_cache])
    v_cache = torch.cat([a.v_cache, b.v_cache])
    for case in (a, b):
        case.k_cache, case.v_cache = k_cache, v_cache
    attn = RaggedVerifyAttention(AttentionShape(16, 6, 32, 8, 2, 16, 3, num_pages=k_cache.shape[0], max_verify_len=8,
                                                num_kv_splits=splits), device, dtype)
    return a, b, attn


@pytest.mark.parametrize("name, policy, splits", [("triton", ("work", None), 1), ("triton", ("cores", 3), 2),
                                                  ("torch", ("work", None), 1)])
@pytest.mark.parametrize("device_table", [False, True])
def test_replay_two_layouts_same_tier(name, policy, splits, device_table, device):
    """Plans of two layouts in turn (through both staging buffers off the CPU), with a host block table
    (checked, staged) or the device's own (copied on the device)."""
    a, b, attn = _two_layouts_same_tier(device, torch.float32, splits)
    out = torch.empty_like(a.q)
    with backend(name):
        for case in (a, b, a, b):
            attn.plan(case.layout, case.prefix, case.table.to(device) if device_table else case.table)
            run_and_check(case, policy=policy, attn=attn, out=out)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_replan_smaller_step_clears_the_bigger_ones_tail(name, device):
    """plan only clears what the previous plan wrote: after a bigger step the buffers equal a fresh plan's."""
    dims = dict(hkv=2, group=2, d=8, page_size=4, dtype=torch.float32, device=device)
    big = build_case(5, [3, 2, 4], [9, 13, 2], padding=3, **dims)
    small = build_case(6, [2], [5], **dims)
    small.table = torch.cat([small.table, small.table[:, :1]], 1)   # a different block-table width too
    shape = AttentionShape(big.layout.graph_num_tokens, big.layout.num_slots, big.table.shape[1], 4, 2, 8, 4,
                           num_pages=max(big.k_cache.shape[0], small.k_cache.shape[0]))
    with backend(name):
        reused, fresh = (RaggedVerifyAttention(shape, device, torch.float32) for _ in range(2))
        reused.plan(big.layout, big.prefix, big.table)
        reused.plan(small.layout, small.prefix, small.table)
        fresh.plan(small.layout, small.prefix, small.table)
        for got, want in zip(reused.meta, fresh.meta):
            assert torch.equal(torch.as_tensor(got), torch.as_tensor(want))
        assert torch.equal(reused._kv_slots, fresh._kv_slots)
        run_and_check(small, attn=reused)


@pytest.mark.cuda
def test_cuda_graph_replay_two_layouts(device):
    a, b, attn = _two_layouts_same_tier(device, torch.bfloat16)
    q_buf, out, lse = torch.empty_like(a.q), torch.empty_like(a.q), torch.empty(a.q.shape[:2], device=device)
    attn.plan(a.layout, a.prefix, a.table)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attn.run(q_buf, a.k_cache, a.v_cache, out=out, lse=lse)  # warm-up compiles the kernel
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q_buf, a.k_cache, a.v_cache, out=out, lse=lse)
    for case in (b, a, b):
        attn.plan(case.layout, case.prefix, case.table)
        write_kv(case.k_new, case.v_new, case.k_cache, case.v_cache, attn.kv_slots)
        q_buf.copy_(case.q)
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = ragged_attention_ref(case.q, case.k_cache, case.v_cache, attn.meta, attn.sm_scale)
        n = case.layout.total_rows
        torch.testing.assert_close(out[:n].double(), ref[:n], rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(lse[:n].double(), ref_lse[:n], rtol=1e-2, atol=1e-2)
        assert bool((out[n:] == 0).all())


@pytest.mark.cuda
@pytest.mark.parametrize("d, page_size, group", [(64, 16, 1), (128, 1, 4), (128, 64, 8), (256, 16, 2)])
def test_cuda_production_head_dims(d, page_size, group, device):
    for dtype in TOL:
        case = build_case(d, [4, 16, 1, 9], [511, 2000, 0, 1300], hkv=2, group=group, d=d,
                          page_size=page_size, dtype=dtype, device=device, padding=3)
        run_and_check(case)


@pytest.mark.parametrize("name", ["triton", "torch"])
@settings(max_examples=10)
@given(rows=st.integers(0, 20), page_size=st.sampled_from([1, 3, 8]), seed=st.integers(0, 2**16),
       dtype=st.sampled_from(list(TOL)))
def test_write_kv_matches_reference_and_skips_padding(name, rows, page_size, seed, dtype, device):
    gen = torch.Generator().manual_seed(seed)
    num_pages = rows // page_size + 3
    slots = torch.randperm(num_pages * page_size, generator=gen)[:rows]
    slots[torch.rand(rows, generator=gen) < 0.3] = -1
    k = torch.randn(rows, 2, 5, generator=gen).to(dtype).to(device)
    v = torch.randn(rows, 2, 5, generator=gen).to(dtype).to(device)
    caches = [_poisoned_cache(num_pages, page_size, 2, 5, dtype, device) for _ in range(4)]
    write_kv_ref(k, v, caches[0], caches[1], slots.to(device))
    with backend(name):
        write_kv(k, v, caches[2], caches[3], slots.to(device=device, dtype=torch.int32))
    for got, want in ((caches[2], caches[0]), (caches[3], caches[1])):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    written = torch.zeros(num_pages * page_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat = caches[2].reshape(num_pages * page_size, -1).cpu()
    assert bool(flat[~written].isnan().all()) and not flat[written].isnan().any()
    assert bool((caches[0].reshape(num_pages * page_size, 2, 5)[slots[slots >= 0].to(device)] ==
                 k[slots >= 0]).all())


def _small(device, dtype=torch.float32):
    return build_case(3, [2, 3], [5, 0], hkv=2, group=2, d=8, page_size=4, dtype=dtype, device=device)


@pytest.mark.parametrize("make, needle, exc", [
    (lambda c: RaggedVerifyAttention(AttentionShape(4, 2, 2, 6, 4, 8, 4), c.q.device, torch.float32), "num_q_heads=6",
     ValueError),
    (lambda c: RaggedVerifyAttention(AttentionShape(4, 2, 2, 4, 2, 8, 4), c.q.device, torch.float64), "torch.float64",
     TypeError),
    (lambda c: RaggedVerifyAttention(AttentionShape(4, 2, 2, 4, 2, 8, 0), c.q.device, torch.float32), "page_size",
     ValueError),
    (lambda c: c.attention().run(c.q[:, :2], c.k_cache, c.v_cache), "q must have shape [5, 4, 8]", ValueError),
    (lambda c: c.attention().run(c.q, c.k_cache[:, :, :1], c.v_cache), "k_cache must have shape", ValueError),
    (lambda c: c.attention().run(c.q.double(), c.k_cache, c.v_cache), "q has dtype torch.float64", TypeError),
    (lambda c: verify_attention(c.q.double(), (c.k_cache, c.v_cache), c.layout, c.prefix, c.table),
     "torch.float64 is not supported", TypeError),
    (lambda c: verify_attention(c.q, (c.k_cache, c.v_cache), c.layout, c.prefix + 10, c.table),
     "request 0 writes positions up to 16", ValueError),
    (lambda c: verify_attention(c.q, (c.k_cache, c.v_cache), c.layout, c.prefix, c.table * 0 - 1),
     "block_table[0, 0] = -1", ValueError),
    (lambda c: verify_attention(c.q, (c.k_cache, c.v_cache), c.layout, c.prefix, c.table + 100),
     "is not a page id in [0, ", ValueError),
    (lambda c: verify_attention(c.q, (c.k_cache, c.v_cache), c.layout, [-1, 0], c.table),
     "prefix_lens[0] = -1", ValueError),
    (lambda c: verify_attention(c.q, (c.k_cache, c.v_cache), c.layout, [1.0, 2.0], c.table),
     "prefix_lens must hold ints, got 1.0", TypeError),
    (lambda c: verify_attention(c.q, c.k_cache, c.layout, c.prefix, c.table),
     "kv_cache must be a (k_cache, v_cache) pair, got Tensor", TypeError),
    (lambda c: RaggedVerifyAttention(AttentionShape(2, 2, 4, 4, 2, 8, 4), c.q.device, torch.float32).plan(c.layout,
                                                                                                          c.prefix,
                                                                                                          c.table),
     "max_rows=2", ValueError),
    (lambda c: RaggedVerifyAttention(AttentionShape(8, 2, 4, 4, 2, 8, 4), c.q.device, torch.float32).run(c.q,
                                                                                                         c.k_cache,
                                                                                                         c.v_cache),
     "before plan", RuntimeError),
    (lambda c: write_kv(c.k_new, c.v_new, c.k_cache, c.v_cache, torch.zeros(3, dtype=torch.int32, device=c.q.device)),
     "kv_slots must be", ValueError),
    (lambda c: write_kv(c.k_new[:, :1], c.v_new, c.k_cache, c.v_cache, torch.zeros(5, dtype=torch.int32, device=c.q.device)),
     "k must be [rows, Hkv, D]", ValueError),
])
def test_bad_input_names_the_value(make, needle, exc, device):
    with pytest.raises(exc) as info:
        make(_small(device))
    assert needle in str(info.value)


def test_verify_attention_one_shot_returns_lse(device):
    case = _small(device)
    write_kv(case.k_new, case.v_new, case.k_cache, case.v_cache, case.attention().kv_slots)
    out, lse = verify_attention(case.q, (case.k_cache, case.v_cache), case.layout, case.prefix, case.table,
                                sm_scale=0.3, return_lse=True)
    ref, ref_lse = ragged_attention_ref(case.q, case.k_cache, case.v_cache, case.attention(sm_scale=0.3).meta, 0.3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


@jit
def _split_offset_kernel(out_ptr, split, row, stride_split, stride_row):
    tl.store(out_ptr, RA._split_offset(split, row, stride_split, stride_row))


@pytest.mark.parametrize("split, row, hq_d", [(15, 35_000, 4096), (15, 2**16 - 1, 2**15), (1, 3, 16), (0, 0, 16)])
def test_split_offsets_do_not_overflow_int32(split, row, hq_d, device, triton_backend):
    """The merge kernel's (split, row) offset at serving sizes (16 splits x 35k rows x Hq x D = 4096 passes
    2**31 elements): the interpreter computes int32 as int32, so an int32 product would wrap here."""
    stride_split = RA.split_rows(row + 1) * hq_d
    out = torch.full((1,), -1, dtype=torch.int64, device=device)
    _split_offset_kernel[(1,)](out, split, row, stride_split, hq_d)
    assert int(out) == split * stride_split + row * hq_d


def test_split_workspace_is_bounded_and_splits_follow_rows(device):
    """A 4k-token prefill at 16 splits would need 16 x 4096 fp32 rows of Hq x D (1 GiB at Hq x D = 4096): the
    workspace holds SPLIT_WORKSPACE_ROWS rows, a long launch does not split, a short one splits fully."""
    ws = RA.split_workspace(RA.MAX_KV_SPLITS, 4096, 32, 128, torch.device("meta"))
    assert ws.out.shape == (RA.SPLIT_WORKSPACE_ROWS, 32, 128) and ws.lse.shape == (RA.SPLIT_WORKSPACE_ROWS, 32)
    assert RA.split_capacity(ws, 4096) == RA.split_capacity(ws, 1025) == 1
    assert RA.split_capacity(ws, 300) == RA.SPLIT_WORKSPACE_ROWS // RA.split_rows(300)
    assert RA.split_capacity(ws, 1) == RA.split_capacity(ws, 128) == RA.MAX_KV_SPLITS
    assert RA.split_workspace(1, 4096, 32, 128, torch.device("meta")) is None
    small = RA.split_workspace(3, 5, 2, 8, torch.device("meta"))
    assert small.out.shape[0] == 3 * RA.split_rows(5) and RA.split_capacity(small, 5) == 3


@settings(max_examples=60, deadline=None)
@given(data=st.data(), block_q=st.sampled_from([1, 4, 16]), block_n=st.sampled_from([16, 64]),
       capacity=st.sampled_from([1, 3, 16]), splits=st.sampled_from([None, 1, 3]),
       target=st.sampled_from([0, 8, 264]))
def test_work_list_covers_every_tile_once(data, block_q, block_n, capacity, splits, target, device):
    """Every query tile of every slot (ghosts too) appears with shares 0..chunks-1 whose kv ranges tile its
    causal range [0, kv_end) in order; chunks <= capacity (forced: min(splits, capacity)); longest first."""
    b = data.draw(st.integers(0, 6))
    vlens = data.draw(st.lists(st.integers(1, 40), min_size=b, max_size=b))
    ghosts = data.draw(st.lists(st.integers(0, 8), max_size=3))
    prefix = np.array(data.draw(st.lists(st.integers(0, 3000), min_size=b, max_size=b)) + [0] * len(ghosts))
    slot_lens = np.array(vlens + ghosts, dtype=np.int64)
    seqused = np.array(vlens + [0] * len(ghosts), dtype=np.int64)
    work, chunks = RA.plan_work(slot_lens, seqused, prefix, block_q=block_q, block_n=block_n, capacity=capacity,
                                splits=splits, target=target, max_entries=10**6)
    assert work.dtype == np.int32 and chunks.shape == slot_lens.shape and (chunks >= 1).all()
    assert (chunks <= capacity).all() and (splits is None or capacity == 1 or (chunks == min(splits, capacity)).all())
    lengths = work[:, 3] - work[:, 2]
    assert (lengths >= 0).all() and (np.diff(lengths) <= 0).all()
    entries = {}
    for slot, q0, lo, hi, part in work.tolist():
        entries.setdefault((slot, q0), []).append((part, lo, hi))
    tiles = {(s, q0) for s in range(slot_lens.size) for q0 in range(0, int(slot_lens[s]), block_q)}
    assert set(entries) == tiles
    for (slot, q0), shares in entries.items():
        shares.sort()
        assert [p for p, _, _ in shares] == list(range(chunks[slot]))
        kv_end = prefix[slot] + min(q0 + block_q, seqused[slot]) if q0 < seqused[slot] else 0
        at = 0
        for _, lo, hi in shares:
            assert lo == at or lo == hi == kv_end, shares
            at = max(at, hi)
        assert at == kv_end


def test_kv_chunks_follow_live_slots_not_ghosts(device, monkeypatch):
    """By default the kv chunking fills the GPU for the plan's live requests: 1 live request among 40 slots
    is cut into chunks (up to the 2 x 8 SMs / 2 kv heads = 8 entries, in BLOCK_N shares), its 40 ghost slots
    are not, and 40 live requests are not cut (a fake GPU of 8 SMs)."""
    monkeypatch.setattr(RA, "sm_count", lambda _device: 8)
    attn = RaggedVerifyAttention(AttentionShape(64, 48, 128, 4, 2, 8, 4, max_verify_len=1), device, torch.float32)
    table = torch.arange(40 * 128, dtype=torch.int32).view(40, 128) % 64
    for live, prefix in ((1, 500), (40, 500)):
        lens = torch.ones(live, dtype=torch.int32, device=device)
        layout = RaggedVerifyLayout.from_verify_lens(lens, tiers=[41], graph_slots=41, width=1)
        attn.plan(layout, [prefix] * live, table[:live].to(device))
        chunks = attn.meta.chunks[:41].cpu()
        if live == 1:
            assert 1 < int(chunks[0]) <= RA.work_target(device, 2) and bool((chunks[1:] == 1).all())
        else:
            assert bool((chunks == 1).all())
        assert int(attn.meta.work_count) == int(chunks.sum())


def test_long_prompt_runs_as_many_query_tiles(device, triton_backend):
    """A 100-row prefill of one request is ceil(100 / 16) work entries (one per query tile, run in parallel,
    the longest kv range first; one kv chunk each, as on a CUDA device kv chunking may add more), and equals
    the reference."""
    case = build_case(4, [100, 3], [30, 7], hkv=2, group=2, d=8, page_size=16, dtype=torch.float32, device=device)
    attn = case.attention(num_kv_splits=1)
    work = attn.meta.work[: int(attn.meta.work_count)].cpu()
    assert sorted(work[:, 1].tolist()) == [0, 0, 16, 32, 48, 64, 80, 96]
    assert work[0].tolist()[:4] == [0, 96, 0, 130] and bool((work[:-1, 3] - work[:-1, 2] >= work[1:, 3] - work[1:, 2]).all())
    run_and_check(case, attn=attn)


def test_plan_reads_nothing_from_the_device(device):
    """On the `meta` device any read to the host raises: a plan of a host-built layout moved to the device
    (`layout.host`) with host prefixes and the device's own block table reads nothing back, twice in a row
    (both staging buffers), and its metadata reach the device in one copy."""
    meta = torch.device("meta")
    attn = RaggedVerifyAttention(AttentionShape(16, 6, 8, 4, 2, 8, 4, max_verify_len=4, num_pages=64), meta,
                                 torch.float32)
    copies = []
    real_copy = torch.Tensor.copy_
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "copy_", lambda self, src, non_blocking=False: (
            copies.append((self.device.type, src.device.type)), real_copy(self, src, non_blocking))[1])
        for lens, prefix in (([2, 4, 1], [5, 0, 9]), ([3], [12])):
            layout = RaggedVerifyLayout.from_verify_lens(torch.tensor(lens, dtype=torch.int32), tiers=[12],
                                                         graph_slots=6, width=4).to(meta)
            assert layout.host is not None and layout.verify_lens.device == meta
            copies.clear()
            attn.plan(layout, torch.tensor(prefix), torch.zeros(len(lens), 8, dtype=torch.int32, device=meta))
            assert copies.count(("meta", "cpu")) == 1, copies   # the staged metadata, one host-to-device copy
            assert ("cpu", "meta") not in copies
    with pytest.raises(NotImplementedError, match="meta"):  # the device is not blind: a read does raise
        attn.plan(dataclasses.replace(layout, host=None), torch.tensor([12]), torch.zeros(1, 8, dtype=torch.int32))
