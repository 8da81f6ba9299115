"""The NPU form of the kernels' inner-loop compares (exact fp32, `dspark.kernels.compare`) gives the reference's
results: the Ascend-shaped launch (`cores` policy) switches it on, the `work` policy keeps the integer form."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.ascend.launch import integer_compares
from dspark.kernels import accept, dispatch, kv_write, layout, topk
from dspark.kernels.compare import FP32_EXACT
from tests.plan.test_allocate import cases

ASCEND = ("cores", {"vector": 3, "dot": 2})


@pytest.mark.cpu_only(reason="the policy's switch: no launch")
def test_the_switch_follows_the_policy_and_the_bound() -> None:
    cpu = torch.device("cpu")
    assert not dispatch.fp32_compares(cpu, 10)
    with dispatch.launch_policy(*ASCEND):
        assert dispatch.fp32_compares(cpu, FP32_EXACT - 1) and not dispatch.fp32_compares(cpu, FP32_EXACT)
    with dispatch.launch_policy("work"):
        assert not dispatch.fp32_compares(cpu, 10)


@settings(max_examples=20)
@given(case=cases(max_b=7, max_gamma=6), zeros=st.integers(0, 3))
def test_topk_fp32_equals_the_reference(case, zeros, device) -> None:
    """Ties, zeros (eps may be 0: a zero survival is a valid key 0.0) and invalid keys (-1: NaN in fp32)."""
    cfg, s, budget = case
    if s.numel() and zeros:
        s[:, -zeros:] = 0.0
    s = s.to(device)
    want = topk.verify_lens_ref(s, budget, cfg.floor, cfg.cap, cfg.survival_eps)
    for policy in (("work", None), ASCEND):
        with dispatch.launch_policy(*policy):
            out = torch.full((s.shape[0],), -7, dtype=torch.int32, device=device)
            got = topk.verify_lens_triton(s, budget, cfg.floor, cfg.cap, cfg.survival_eps, out=out)
        assert torch.equal(got, want), (policy, s, budget, cfg)


@st.composite
def accept_inputs(draw):
    b, gamma, vocab = draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.sampled_from([5, 16, 37, 1100]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    vl = torch.randint(1, gamma + 2, (b,), generator=gen, dtype=torch.int32)
    p = torch.rand(b, gamma + 1, vocab, generator=gen)
    if draw(st.booleans()):   # exact ties and a NaN: the first maximum / the first NaN wins
        p = (p * 4).round() / 4
        p[0, 0, draw(st.integers(0, vocab - 1))] = float("nan")
    q = torch.rand(b, gamma, vocab, generator=gen)
    draft = torch.where(torch.rand(b, gamma, generator=gen) < 0.6, p[:, :gamma].nan_to_num(2.0).argmax(-1),
                        torch.randint(0, vocab, (b, gamma), generator=gen))
    u = torch.rand(b, gamma + 1, generator=gen)
    return draft, p, q, vl, u


@settings(max_examples=15)
@given(inputs=accept_inputs())
def test_accept_fp32_equals_the_reference_and_the_integer_form(inputs, device) -> None:
    draft, p, q, vl, u = (t.to(device) for t in inputs)
    want = accept.greedy_ref(draft, p, vl, None)
    b = draft.shape[0]
    outs = {}
    for policy in (("work", None), ASCEND):
        poison = (torch.full((b,), -7, dtype=torch.int32, device=device),
                  torch.full((b,), -7, dtype=torch.int64, device=device))
        probs = (p.nan_to_num(0.5) / p.nan_to_num(0.5).sum(-1, keepdim=True), q / q.sum(-1, keepdim=True))
        with dispatch.launch_policy(*policy):
            greedy = accept.greedy_triton(draft, p, vl, None, *poison)
            greedy = tuple(t.clone() for t in greedy)
            outs[policy[0]] = accept.sampling_triton(draft, probs[1], probs[0], vl, None, u, *poison)
        assert all(torch.equal(g, w) for g, w in zip(greedy, want)), (policy, greedy, want)
    # same accumulation order in both forms: only the compares differ, so the draws agree bit for bit
    assert all(torch.equal(a, c) for a, c in zip(outs["work"], outs["cores"]))


@settings(max_examples=15)
@given(lens=st.lists(st.integers(0, 6), max_size=12), d=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_layout_and_kv_write_fp32_equal_the_references(lens, d, seed, device) -> None:
    """qo_indptr, row maps, pack, scatter and the paged K/V write (negative slots write nothing), poisoned."""
    gen = torch.Generator().manual_seed(seed)
    slot_lens = torch.tensor(lens, dtype=torch.int32).to(device)
    rows, w = int(slot_lens.sum()), max(lens, default=0) + 1
    i32 = lambda n: torch.full((n,), -7, dtype=torch.int32, device=device)  # noqa: E731
    strided = torch.randn(len(lens), w, d, generator=gen).to(device)
    qo = layout.qo_indptr_ref(slot_lens)
    row_slot, row_within = layout.row_maps_ref(slot_lens, rows)
    packed = layout.pack_ref(strided, row_slot, row_within, rows, float("nan"))
    slots = torch.randperm(4 * (rows + 1), generator=gen)[:rows]
    slots[torch.rand(rows, generator=gen) < 0.3] = -1
    slots = slots.to(device, torch.int32)
    k, v = (torch.randn(rows, 2, d, generator=gen).to(device) for _ in range(2))
    want_k, want_v = (torch.full((rows + 1, 4, 2, d), float("nan"), device=device) for _ in range(2))
    kv_write.write_kv_ref(k, v, want_k, want_v, slots)
    with dispatch.launch_policy(*ASCEND):
        assert dispatch.fp32_compares(device, rows + 1024)
        assert torch.equal(layout.qo_indptr_triton(slot_lens, i32(len(lens) + 1)), qo)
        if rows:
            got = layout.row_maps_triton(slot_lens, i32(rows), i32(rows))
            assert torch.equal(got[0], row_slot) and torch.equal(got[1], row_within)
        out = torch.full((rows, d), -7.0, device=device)
        got = layout.pack_triton(strided, row_slot, row_within, rows, float("nan"), out)
        assert torch.equal(got.nan_to_num(-1e9), packed.nan_to_num(-1e9))
        out = torch.full((len(lens), w, d), -7.0, device=device)
        assert torch.equal(layout.scatter_triton(packed, qo, w, -1.0, out),
                           layout.scatter_ref(packed, qo, w, rows, -1.0))
        kc, vc = (torch.full_like(want_k, float("nan")) for _ in range(2))
        kv_write.write_kv_triton(k, v, kc, vc, slots)
        assert torch.equal(kc.nan_to_num(-1e9), want_k.nan_to_num(-1e9))
        assert torch.equal(vc.nan_to_num(-1e9), want_v.nan_to_num(-1e9))


@pytest.mark.cpu_only(reason="static listing of the kernel sources")
def test_the_checker_lists_the_integer_compares_that_remain() -> None:
    report = integer_compares()
    kernels = {r.kernel for r in report}
    assert {"_threshold_kernel", "_ragged_attention_kernel", "_row_argmax"} <= kernels
    by_kernel = {k: [r for r in report if r.kernel == k] for k in kernels}
    # the radix digits need all 31 key bits: they stay integer; the attention kv loop is all fp32
    assert any(not r.fp32 and ">>" in r.text for r in by_kernel["_threshold_kernel"])
    kv_loop = [r for r in by_kernel["_ragged_attention_kernel"] if "pos" in r.text]
    assert len(kv_loop) == 2 and all(r.fp32 for r in kv_loop)
    for kernel in ("_lens_kernel", "_qo_indptr_kernel", "_copy_row", "_write_kv_kernel", "_row_maps_kernel"):
        assert all(r.fp32 for r in by_kernel[kernel]), kernel
    remaining = {r.kernel for r in report if not r.fp32}
    assert remaining, "the report lists what remains integer"
