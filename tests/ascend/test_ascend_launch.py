"""Ascend launch policy: static kernel-source rules, grid bound, and identical outputs under both policies."""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Callable

import pytest
import torch
import triton
import triton.language as tl

import dspark.kernels
from dspark.ascend.launch import MAX_GRID, check_kernel_modules, check_kernel_source
from dspark.kernels import dispatch
from dspark.verify.attention import AttentionShape

POLICIES = (("work", None), ("cores", 1), ("cores", 3), ("cores", {"vector": 3, "dot": 2}))


@pytest.mark.cpu_only(reason="static checks of the kernel sources")
def test_every_kernel_module_follows_the_ascend_rules() -> None:
    found = check_kernel_modules()
    assert any(p.endswith("dispatch.py") for p in found) and any(p.endswith("layout.py") for p in found)
    bad = [str(v) for vs in found.values() for v in vs]
    assert bad == []


GOOD = textwrap.dedent('''
    import triton, triton.language as tl
    from dspark.kernels import dispatch

    @dispatch.kernel_kind("vector")
    @triton.jit
    def _k(x_ptr, cnt_ptr, n, BLOCK: tl.constexpr):
        for item in tl.range(tl.program_id(0), n, tl.num_programs(0)):
            x = tl.load(x_ptr + item)
            s = tl.sort(x)  # ascend: float-sort
            tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")

    @triton.jit
    def _tile(a, b):
        return tl.dot(a, b)

    @dispatch.kernel_kind("dot")
    @triton.jit
    def _mm(a_ptr, n):
        for item in tl.range(tl.program_id(0), n, tl.num_programs(0)):
            a = tl.load(a_ptr + item)
            tl.store(a_ptr + item, _tile(a, a))

    def launch(x, cnt):
        g = dispatch.grid(x.numel(), x.device, _k)
        _k[dispatch.grid(x.numel(), x.device, _k)](x, cnt, x.numel(), BLOCK=4)
        _k[g](x, cnt, x.numel(), BLOCK=4)
        _mm[dispatch.grid(x.numel(), x.device, kernel=_mm)](x, x.numel())
''')

BAD = textwrap.dedent('''
    import triton, triton.language as tl

    @triton.jit
    def _k(x_ptr, cnt_ptr, n):
        pid = tl.program_id(0)
        for i in tl.range(tl.program_id(1), n, tl.num_programs(1)):
            v = tl.sort(tl.load(x_ptr + i))
            tl.atomic_add(cnt_ptr, v.to(tl.int64))
            tl.atomic_max(cnt_ptr, 1, sem="relaxed")

    @dispatch.kernel_kind("vector")
    @triton.jit
    def _mm(a_ptr, n):
        for item in tl.range(tl.program_id(0), n, tl.num_programs(0)):
            a = tl.load(a_ptr + item)
            tl.store(a_ptr + item, tl.dot(a, a))

    @dispatch.kernel_kind("dot")
    @triton.jit
    def _v(a_ptr, n):
        for item in tl.range(tl.program_id(0), n, tl.num_programs(0)):
            tl.store(a_ptr + item, 1.0)

    def launch(x, cnt):
        _k[(x.numel(),)](x, cnt, x.numel())
        _mm[dispatch.grid(x.numel(), x.device, _v)](x, x.numel())
        _v[dispatch.grid(x.numel(), x.device, _v)](x, x.numel())
''')


@pytest.mark.cpu_only(reason="static checks of kernel sources")
def test_checker_accepts_conforming_source() -> None:
    assert check_kernel_source(GOOD) == []


@pytest.mark.cpu_only(reason="static checks of kernel sources")
def test_checker_flags_each_rule() -> None:
    got = [(v.line, v.rule) for v in check_kernel_source(BAD, "bad.py")]
    assert got == [(5, "kind"), (6, "persistent"), (7, "persistent"), (8, "sort"), (9, "atomic"), (10, "atomic"),
                   (14, "kind"), (21, "kind"), (26, "grid"), (27, "grid")]
    msgs = "\n".join(str(v) for v in check_kernel_source(BAD, "bad.py"))
    assert "bad.py:9: [atomic]" in msgs and "sem='relaxed'" in msgs and "dispatch.grid(n, device, _k)" in msgs
    assert "_mm is declared 'vector' but uses tl.dot" in msgs and "_v is declared 'dot' but does not use" in msgs
    assert "_k declares no kind" in msgs


@pytest.mark.cpu_only(reason="the policy's bookkeeping: no launch")
def test_kinds_and_policies_are_checked() -> None:
    with pytest.raises(ValueError, match="kernel kind must be one of"):
        dispatch.kernel_kind("cube")
    with pytest.raises(ValueError, match="declares no launch kind"):
        dispatch.grid(4, torch.device("cpu"), object())
    for bad in (0, {"vector": 4}, {"vector": 4, "dot": 0}, True):
        with pytest.raises(ValueError, match="num_cores >= 1 for each kind"):
            with dispatch.launch_policy("cores", bad):
                pass
    with dispatch.launch_policy("cores", {"vector": 5, "dot": 2}):
        assert dispatch.grid(100, torch.device("cpu"), _visit_kernel) == (5,)
        assert dispatch.grid(100, torch.device("cpu"), _dot_kernel) == (2,)
        assert dispatch.grid(1, torch.device("cpu"), _dot_kernel) == (1,)


@pytest.mark.parametrize("policy", [("work", None), ("cores", 100_000)])
def test_grid_never_exceeds_the_core_dim_limit(policy, device) -> None:
    with dispatch.launch_policy(*policy):
        for kernel in (_visit_kernel, _dot_kernel):
            assert dispatch.grid(10**6, device, kernel) == (MAX_GRID,)
            assert dispatch.grid(0, device, kernel) == (1,)


@dispatch.kernel_kind("vector")
@triton.jit
def _visit_kernel(x_ptr, out_ptr, visits_ptr, n, BLOCK: tl.constexpr):
    for item in tl.range(tl.program_id(0), n, tl.num_programs(0)):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + item * BLOCK + offs)
        tl.store(out_ptr + item * BLOCK + offs, x * 2.0 + item)
        tl.atomic_add(visits_ptr + item, 1)


def _visit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[0]
    out = torch.full_like(x, float("nan"))
    visits = torch.zeros(n, dtype=torch.int32, device=x.device)
    _visit_kernel[dispatch.grid(n, x.device, _visit_kernel)](x, out, visits, n, BLOCK=x.shape[1])
    return out, visits


@dispatch.kernel_kind("dot")
@triton.jit
def _dot_kernel(a_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for item in tl.range(tl.program_id(0), n, tl.num_programs(0)):
        a = tl.load(a_ptr + item * BLOCK * BLOCK + offs[:, None] * BLOCK + offs[None, :])
        tl.store(out_ptr + item * BLOCK * BLOCK + offs[:, None] * BLOCK + offs[None, :], tl.dot(a, a))


@pytest.mark.parametrize("n", [0, 1, 7])
def test_persistent_loop_same_under_both_policies(device, n) -> None:
    x = torch.randn(n, 4, device=device)
    results = []
    for policy in POLICIES:
        with dispatch.launch_policy(*policy):
            results.append(_visit(x))
    ref_out, ref_visits = results[0]   # the `work` policy
    assert torch.equal(ref_visits, torch.ones(n, dtype=torch.int32, device=device))
    assert torch.equal(ref_out, x * 2.0 + torch.arange(n, device=device)[:, None])
    for out, visits in results:
        assert torch.equal(out, ref_out) and torch.equal(visits, ref_visits)


@pytest.mark.parametrize("n", [1, 5])
def test_dot_kernel_same_under_both_policies(device, n) -> None:
    """A `dot` kernel launches on its own core count ({"dot": 2} while vector kernels get 3)."""
    a = torch.randn(n, 16, 16, generator=torch.Generator().manual_seed(n)).to(device)
    want = torch.bmm(a, a)
    for policy in POLICIES:
        out = torch.full_like(a, float("nan"))
        with dispatch.launch_policy(*policy):
            _dot_kernel[dispatch.grid(n, a.device, _dot_kernel)](a, out, n, BLOCK=16)
        torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)   # tl.dot may run in tf32 on a GPU


# (kernel launch, the exact expected output, or None where only a float reference within tolerance exists:
# then every policy must give the `work` policy's output bit for bit)
Case = tuple[Callable[[], torch.Tensor], "torch.Tensor | None"]


def _topk_cases(device: torch.device) -> list[Case]:
    """Global top-k allocation: ties (quantized survival), NaN-free and thresholded, B = 1 and odd B."""
    from dspark.kernels import topk

    def case(b: int, gamma: int, budget: int, floor: int, seed: int) -> Case:
        gen = torch.Generator().manual_seed(seed)
        s = (torch.rand(b, gamma, generator=gen) * 8).round() / 8   # many ties
        s = torch.cummin(s, dim=1).values.to(device)

        def run() -> torch.Tensor:
            out = torch.full((b,), -7, dtype=torch.int32, device=device)   # poison
            return topk.verify_lens_triton(s, budget, floor, gamma + 1, 1e-6, out=out)
        return run, topk.verify_lens_ref(s, budget, floor, gamma + 1, 1e-6)

    return [case(1, 3, 2, 1, 0), case(5, 4, 7, 1, 1), case(7, 6, 40, 2, 2), case(3, 5, 0, 1, 3)]


def _kv_write_cases(device: torch.device) -> list[Case]:
    """Paged K/V cache write: random slots, some negative (padding rows write nothing); NaN-poisoned caches."""
    from dspark.kernels import kv_write

    def case(rows: int, page_size: int, seed: int) -> Case:
        gen = torch.Generator().manual_seed(seed)
        pages = rows // page_size + 2
        slots = torch.randperm(pages * page_size, generator=gen)[:rows]
        slots[torch.rand(rows, generator=gen) < 0.3] = -1
        slots = slots.to(device)
        k, v = (torch.randn(rows, 2, 5, generator=gen).to(device) for _ in range(2))
        poisoned = lambda: torch.full((pages, page_size, 2, 5), float("nan"), device=device)  # noqa: E731
        want_k, want_v = poisoned(), poisoned()
        kv_write.write_kv_ref(k, v, want_k, want_v, slots)

        def run() -> torch.Tensor:
            kc, vc = poisoned(), poisoned()
            kv_write.write_kv_triton(k, v, kc, vc, slots.to(torch.int32))
            return torch.stack([kc, vc]).nan_to_num(-1e9)
        return run, torch.stack([want_k, want_v]).nan_to_num(-1e9)

    return [case(0, 4, 0), case(1, 1, 1), case(13, 3, 2)]


def _attention_cases(device: torch.device) -> list[Case]:
    """Ragged verify attention (one kv split and three, which adds the merge kernel), with a ghost slot."""
    from dspark.verify.attention import RaggedVerifyAttention
    from dspark.verify.layout import RaggedVerifyLayout

    def case(splits: int, seed: int) -> Case:
        gen = torch.Generator().manual_seed(seed)
        layout = RaggedVerifyLayout.from_verify_lens(torch.tensor([2, 3, 1], dtype=torch.int32, device=device),
                                                     tiers=[8], graph_slots=4, width=3)
        prefix, page_size, hkv, hq, d = torch.tensor([5, 0, 9]), 4, 2, 4, 8
        table = torch.randperm(12, generator=gen, dtype=torch.int32)[:12].reshape(3, 4).to(device)
        kc, vc = (torch.randn(12, page_size, hkv, d, generator=gen).to(device) for _ in range(2))
        q = torch.randn(8, hq, d, generator=gen).to(device)
        attn = RaggedVerifyAttention(AttentionShape(8, 4, 4, hq, hkv, d, page_size, num_kv_splits=splits), device,
                                     torch.float32)
        attn.plan(layout, prefix, table)

        def run() -> torch.Tensor:
            out = torch.full_like(q, float("nan"))
            lse = torch.full(q.shape[:2], float("nan"), device=device)
            attn.run(q, kc, vc, out=out, lse=lse)
            return torch.cat([out.flatten(), lse.flatten()])
        return run, None

    return [case(1, 0), case(3, 1)]


def _accept_cases(device: torch.device) -> list[Case]:
    """Greedy and rejection-sampling accept, strided and packed rows, B = 1 and odd B; poisoned outputs."""
    from dspark.kernels import accept
    from dspark.verify.layout import RaggedVerifyLayout

    def case(b: int, gamma: int, vocab: int, packed: bool, sampling: bool, seed: int) -> Case:
        gen = torch.Generator().manual_seed(seed)
        vl = torch.randint(1, gamma + 2, (b,), generator=gen, dtype=torch.int32)
        strided = torch.rand(b, gamma + 1, vocab, generator=gen)
        strided = strided / strided.sum(-1, keepdim=True)
        q = torch.rand(b, gamma, vocab, generator=gen)
        q = (q / q.sum(-1, keepdim=True)).to(device)
        draft = torch.where(torch.rand(b, gamma, generator=gen) < 0.6, strided[:, :gamma].argmax(-1),
                            torch.randint(0, vocab, (b, gamma), generator=gen)).to(device)
        target, row_start = strided, None
        if packed:
            lay = RaggedVerifyLayout.from_verify_lens(vl, tiers=[int(vl.sum()) + 2], width=gamma + 1)
            target, row_start = lay.pack(strided, fill=float("nan")), lay.qo_indptr[:-1].to(device)
        target, vl = target.to(device), vl.to(device)
        u = torch.rand(b, gamma + 1, generator=gen).to(device)
        args = (draft, q, target, vl, row_start, u) if sampling else (draft, target, vl, row_start)

        def run() -> torch.Tensor:
            outs = (torch.full((b,), -7, dtype=torch.int32, device=device),
                    torch.full((b,), -7, dtype=torch.int64, device=device))
            kernel = accept.sampling_triton if sampling else accept.greedy_triton
            correct, bonus = kernel(*args, *outs)
            return torch.cat([correct.long(), bonus])
        # a device may sum the sampling CDF in another order than the reference: compare across policies
        want = None if sampling else torch.cat([t.long() for t in accept.greedy_ref(*args)])
        return run, want

    return [case(1, 3, 7, False, False, 0), case(5, 4, 37, True, False, 1),
            case(1, 2, 5, True, True, 2), case(7, 5, 37, False, True, 3)]


def _layout_cases(device: torch.device) -> list[Case]:
    """qo_indptr, row maps, pack and scatter-back over a tier-padded layout with ghost rows; poisoned outputs."""
    from dspark.kernels import layout as k

    lens = torch.tensor([3, 1, 4, 2, 0, 5], dtype=torch.int32, device=device)   # a zero-length (ghost) slot
    rows, qo = int(lens.sum()), torch.tensor([0, 3, 4, 8, 10], dtype=torch.int32, device=device)
    row_slot, row_within = k.row_maps_ref(lens, rows)
    strided = torch.randn(4, 4, 3, generator=torch.Generator().manual_seed(0)).to(device)
    packed = k.pack_ref(strided, row_slot, row_within, 10, float("nan"))

    def poison(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.full(shape, -7, dtype=dtype, device=device)

    return [
        (lambda: k.qo_indptr_triton(lens, poison(lens.numel() + 1)), k.qo_indptr_ref(lens)),
        (lambda: torch.cat(k.row_maps_triton(lens, poison(rows), poison(rows))), torch.cat([row_slot, row_within])),
        (lambda: k.pack_triton(strided, row_slot, row_within, 10, float("nan"), poison(rows, 3, dtype=torch.float32))
         .nan_to_num(-1e9), packed.nan_to_num(-1e9)),
        (lambda: k.scatter_triton(packed, qo, 4, -1.0, poison(4, 4, 3, dtype=torch.float32)),
         k.scatter_ref(packed, qo, 4, 10, -1.0)),
    ]


# kernel module -> cases (a zero-argument launch and the reference output); every module that defines a
# Triton kernel must appear here so that it runs under both launch policies.
KERNEL_CASES: dict[str, Callable[[torch.device], list[Case]]] = {
    "accept": _accept_cases,
    "layout": _layout_cases,
    "topk": _topk_cases,
    "kv_write": _kv_write_cases,
    "ragged_attention": _attention_cases,
}


@pytest.mark.cpu_only(reason="static inventory of the kernel modules")
def test_every_kernel_module_has_cross_policy_cases() -> None:
    root = Path(dspark.kernels.__file__).parent
    # modules with a launched kernel (one that declares its kind; compare.py holds jit helpers only)
    with_kernels = {p.stem for p in root.glob("*.py") if "\n@dispatch.kernel_kind(" in p.read_text()}
    assert {"accept", "layout", "topk", "kv_write", "ragged_attention"} <= with_kernels
    missing = sorted(with_kernels - set(KERNEL_CASES))
    assert not missing, f"add cross-policy cases for {missing} to KERNEL_CASES in tests/ascend/test_ascend_launch.py"


@pytest.mark.parametrize("module", sorted(KERNEL_CASES))
def test_kernels_identical_under_both_policies(device, module, triton_backend) -> None:
    for run, want in KERNEL_CASES[module](device):
        for policy in POLICIES:
            with dispatch.launch_policy(*policy):
                out = run()
            if want is None:
                want = out
                assert not out.isnan().any(), (module, "NaN in the output")
            assert torch.equal(out, want), (module, policy, out, want)
