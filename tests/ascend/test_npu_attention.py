"""The NPU attention backend and the CPU emulator of the fused infer attention operator.

The emulator is checked against a brute-force dense attention and against dspark's own ragged attention on
hypothesis layouts; the backend's operator arguments against brute-force references of the seed's
section VII.D (rows = sum(verify_lens), cu_seqlens_q = prefix sums, compact outputs scatter back to the
static stride); bad input raises naming the value.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.ascend.attention import NpuVerifyAttention, check_metadata
from dspark.ascend.emulator import FiaArgumentError, FusedInferAttentionEmulator, causal_mask
from dspark.ascend.metadata import AscendVerifyMetadata
from dspark.verify.attention import AttentionShape, verify_attention
from dspark.verify.kv_write import write_kv
from dspark.verify.layout import RaggedVerifyLayout

pytestmark = pytest.mark.cpu_only(reason="the CPU emulator of the NPU operator (perf/ascend_bringup.py --device npu "
                                         "runs the real one)")

PAGE = 128
D = 16


class Recorder(FusedInferAttentionEmulator):
    """The emulator, keeping every call's host lists and row count."""

    def __init__(self) -> None:
        super().__init__(allow_float32=True)
        self.seen: list[dict] = []

    def __call__(self, query, key, value, **kw):
        self.seen.append({"rows": query.shape[0], "q": list(kw["actual_seq_lengths"]),
                          "kv": list(kw["actual_seq_lengths_kv"]), "table": kw["block_table"].clone()})
        return super().__call__(query, key, value, **kw)


def _cache(pages: int, hkv: int, seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(pages, PAGE, hkv, D, generator=g).to(dtype), torch.randn(pages, PAGE, hkv, D, generator=g).to(dtype))


def _table(prefix: list[int], lens: list[int], seed: int) -> tuple[torch.Tensor, int]:
    need = max(-(-(p + v) // PAGE) for p, v in zip(prefix, lens))
    pages = len(prefix) * need + 17   # the operator needs blocks >= the sum over slots, ghosts included
    perm = torch.randperm(pages - 1, generator=torch.Generator().manual_seed(seed))[: len(prefix) * need] + 1
    return perm.reshape(len(prefix), need).to(torch.int32), pages


def brute_force(q, k_cache, v_cache, lens, prefix, table, scale, group) -> torch.Tensor:
    """Row by row: softmax over the request's cached keys at positions <= the row's own (dense loop)."""
    out, row = torch.zeros_like(q), 0
    for i, (v, p) in enumerate(zip(lens, prefix)):
        flat_k = k_cache[table[i].long()].reshape(-1, k_cache.shape[2], D)
        flat_v = v_cache[table[i].long()].reshape(-1, k_cache.shape[2], D)
        for j in range(v):
            n = p + j + 1
            for h in range(q.shape[1]):
                s = (flat_k[:n, h // group] @ q[row, h]) * scale
                out[row, h] = torch.softmax(s, 0) @ flat_v[:n, h // group]
            row += 1
    return out


layouts = st.integers(1, 4).flatmap(lambda b: st.tuples(
    st.lists(st.integers(1, 5), min_size=b, max_size=b), st.lists(st.integers(0, 300), min_size=b, max_size=b),
    st.sampled_from([(4, 2), (4, 4), (8, 2)]), st.integers(0, 2**16)))


@settings(max_examples=25, deadline=None)
@given(layouts)
def test_emulator_equals_brute_force_and_dspark_attention(case) -> None:
    lens, prefix, (hq, hkv), seed = case
    table, pages = _table(prefix, lens, seed)
    kc, vc = _cache(pages, hkv, seed)
    layout = RaggedVerifyLayout.from_verify_lens(lens)
    q = torch.randn(sum(lens), hq, D, generator=torch.Generator().manual_seed(seed + 1))
    attn = NpuVerifyAttention(AttentionShape(sum(lens), len(lens), table.shape[1], hq, hkv, D, PAGE), "cpu",
                              torch.float32, op=FusedInferAttentionEmulator(allow_float32=True))
    attn.plan(layout, prefix, table)
    out = torch.full_like(q, float("nan"))                          # poisoned: every row must be written
    attn.run(q, kc, vc, out=out)
    want = brute_force(q, kc, vc, lens, prefix, table, attn.sm_scale, hq // hkv)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, verify_attention(q, (kc, vc), layout, prefix, table), rtol=1e-5, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(layouts, st.sampled_from([torch.float16, torch.bfloat16]))
def test_emulator_in_the_operator_dtypes(case, dtype) -> None:
    lens, prefix, (hq, hkv), seed = case
    table, pages = _table(prefix, lens, seed)
    kc, vc = _cache(pages, hkv, seed, dtype)
    layout = RaggedVerifyLayout.from_verify_lens(lens)
    q = torch.randn(sum(lens), hq, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    attn = NpuVerifyAttention(AttentionShape(sum(lens), len(lens), table.shape[1], hq, hkv, D, PAGE), "cpu", dtype,
                              op=FusedInferAttentionEmulator())
    attn.plan(layout, prefix, table)
    out = attn.run(q, kc, vc)
    assert out.dtype == dtype
    want = brute_force(q.float(), kc.float(), vc.float(), lens, prefix, table, attn.sm_scale, hq // hkv)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


graph_layouts = st.integers(1, 4).flatmap(lambda b: st.tuples(
    st.lists(st.integers(1, 4), min_size=b, max_size=b), st.lists(st.integers(0, 260), min_size=b, max_size=b),
    st.sampled_from([None, (4, 8, 12, 16)]), st.integers(0, 2**16)))


@settings(max_examples=25, deadline=None)
@given(graph_layouts)
def test_operator_arguments_follow_the_ragged_layout(case) -> None:
    """VII.D: input rows = sum(verify_lens) (the tier when padded); actual_seq_lengths = prefix sums of the
    verify lengths (ghost slots end at the tier); KV lengths L + v (ghosts 1); block table rows = slots."""
    lens, prefix, tiers, seed = case
    w = 4
    slots = len(lens) + 4 if tiers else None
    layout = RaggedVerifyLayout.from_verify_lens(lens, tiers=tiers, graph_slots=slots, width=w)
    table, pages = _table(prefix, lens, seed)
    kc, vc = _cache(pages, 2, seed)
    op = Recorder()
    attn = NpuVerifyAttention(AttentionShape(32, 16, table.shape[1], 4, 2, D, PAGE, max_verify_len=w), "cpu",
                              torch.float32, op=op)
    attn.plan(layout, prefix, table)
    attn.run(torch.randn(layout.graph_num_tokens, 4, D), kc, vc)
    (call,) = op.seen
    total = sum(lens)
    ends = [sum(lens[: i + 1]) for i in range(len(lens))]                      # brute-force prefix sums
    assert call["rows"] == (total if tiers is None else min(t for t in tiers if t >= total))
    assert call["q"][: len(lens)] == ends and call["q"][-1] == call["rows"]
    assert all(a <= b for a, b in zip(call["q"], call["q"][1:]))
    ghosts = layout.num_slots - len(lens)
    assert call["kv"] == [p + v for p, v in zip(prefix, lens)] + [1] * ghosts
    assert torch.equal(call["table"][: len(lens), : table.shape[1]], table)
    assert call["table"].shape[0] == layout.num_slots and not call["table"][len(lens):].any()
    real = attn.kv_slots[:total]
    assert (attn.kv_slots[total:] == -1).all() and (real >= PAGE).all()    # padding rows write nothing


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 4).flatmap(lambda b: st.tuples(
    st.lists(st.integers(1, 4), min_size=b, max_size=b), st.lists(st.integers(0, 200), min_size=b, max_size=b),
    st.integers(0, 2**16))))
def test_compact_outputs_scatter_back_to_the_static_stride(case) -> None:
    """VII.D: a compact step's rows, scattered to the static stride W, equal the static step's rows there
    (same per-position q / k / v, the cache written by each step's own rows)."""
    lens, prefix, seed = case
    w, hq, hkv = 4, 4, 2
    table, pages = _table(prefix, [w] * len(lens), seed)
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(len(lens), w, 3, hq, D, generator=g)                      # by (request, row within)
    base_k, base_v = _cache(pages, hkv, seed)
    outs = {}
    for name, layout in (("compact", RaggedVerifyLayout.from_verify_lens(lens)),
                         ("static", RaggedVerifyLayout.from_verify_lens([w] * len(lens)))):
        kc, vc = base_k.clone(), base_v.clone()
        attn = NpuVerifyAttention(AttentionShape(len(lens) * w, len(lens), table.shape[1], hq, hkv, D, PAGE), "cpu",
                                  torch.float32, op=FusedInferAttentionEmulator(allow_float32=True))
        attn.plan(layout, prefix, table)
        rows = qkv[layout.row_slot.long(), layout.row_within.long()]
        write_kv(rows[:, 1, :hkv].contiguous(), rows[:, 2, :hkv].contiguous(), kc, vc, attn.kv_slots)
        outs[name] = (layout, attn.run(rows[:, 0].contiguous(), kc, vc))
    layout, compact = outs["compact"]
    scattered = layout.scatter(compact.reshape(compact.shape[0], -1), width=w, fill=float("nan"))
    static = outs["static"][1].reshape(len(lens), w, -1)
    for i, v in enumerate(lens):
        torch.testing.assert_close(scattered[i, :v], static[i, :v], rtol=1e-5, atol=1e-5)
        assert torch.isnan(scattered[i, v:]).all()


def _call(**over):
    q = torch.randn(5, 4, D, dtype=torch.float16)
    k = torch.randn(3, PAGE, 2 * D, dtype=torch.float16)
    kw = dict(atten_mask=causal_mask(), block_table=torch.tensor([[1], [2]], dtype=torch.int32), input_layout="TND",
              block_size=PAGE, actual_seq_lengths=[2, 5], actual_seq_lengths_kv=[10, 3], num_heads=4,
              num_key_value_heads=2, scale=0.25, sparse_mode=3)
    kw.update(over)
    return FusedInferAttentionEmulator()(kw.pop("query", q), kw.pop("key", k), kw.pop("value", k), **kw)


@pytest.mark.parametrize("over, message", [
    ({}, None),
    ({"input_layout": "XYZ"}, "input_layout='XYZ' is not a layout of the operator"),
    ({"input_layout": "BSH"}, "input_layout='BSH': the emulator implements only dspark's TND path"),
    ({"actual_seq_lengths": [2, 4]}, "actual_seq_lengths ends at 4 but query has T=5 rows"),
    ({"actual_seq_lengths": [3, 2, 5], "actual_seq_lengths_kv": [1, 1, 1],
      "block_table": torch.zeros(3, 1, dtype=torch.int32)}, r"actual_seq_lengths\[1\] = 2 < actual_seq_lengths\[0\] = 3"),
    ({"actual_seq_lengths_kv": [10]}, "actual_seq_lengths_kv has 1 entries; actual_seq_lengths has 2"),
    ({"actual_seq_lengths_kv": [10, 129]}, r"actual_seq_lengths_kv\[1\] = 129 needs 2 blocks of 128; block_table has 1"),
    ({"actual_seq_lengths": torch.tensor([2, 5])}, "actual_seq_lengths must be a host list of ints"),
    ({"block_size": 16}, "block_size=16: page attention takes 128 to 512"),
    ({"sparse_mode": 3, "atten_mask": None}, r"sparse_mode=3 needs the optimised atten_mask \[2048, 2048\]"),
    ({"sparse_mode": 2}, "sparse_mode=2: TND takes 0"),
    ({"num_heads": 8}, "num_heads=8 must equal query's N=4"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"query": torch.randn(5, 4, D)}, r"query dtype torch.float32 is not one of the operator's"),
    ({"block_table": torch.tensor([[1], [7]], dtype=torch.int32)}, r"block_table\[1, 0\] = 7 is not a block"),
    ({"block_table": torch.tensor([[1], [2]], dtype=torch.int64)}, "block_table must be int32"),
    ({"antiquant_scale": torch.ones(1)}, r"takes none of \['antiquant_scale'\]"),
    ({"key": torch.randn(3, 64, 2 * D, dtype=torch.float16)}, "key and value must have the same shape"),
    ({"key": torch.randn(3, 64, 2 * D, dtype=torch.float16), "value": torch.randn(3, 64, 2 * D, dtype=torch.float16)},
     r"key \[3, 64, 32\] is not a paged cache"),
])
def test_emulator_refuses_what_the_operator_refuses(over, message) -> None:
    if message is None:
        out, lse = _call(**over)
        assert out.shape == (5, 4, D) and out.dtype == torch.float16 and lse.shape == (1,)
        return
    with pytest.raises(FiaArgumentError, match=message):
        _call(**over)


def test_backend_refuses_metadata_of_another_layout_and_a_short_block_table() -> None:
    layout = RaggedVerifyLayout.from_verify_lens([2, 1, 4])
    attn = NpuVerifyAttention(AttentionShape(16, 4, 2, 4, 2, D, PAGE), "cpu", torch.float32,
                              op=FusedInferAttentionEmulator(True))
    table = torch.tensor([[1], [2], [3]], dtype=torch.int32)
    other = AscendVerifyMetadata.from_layout(RaggedVerifyLayout.from_verify_lens([4, 1, 2]), [10, 127, 5], ())
    with pytest.raises(ValueError, match=r"metadata.cu_seqlens_q_host = \[0, 4, 5, 7\] is not this layout's \[0, 2, 3, 7\]"):
        attn.plan(layout, [10, 127, 5], table, metadata=other)
    stale = AscendVerifyMetadata.from_layout(layout, [10, 126, 5], ())
    with pytest.raises(ValueError, match=r"metadata.seq_lens_kv_host = \[12, 127, 9\] is not this layout's \[12, 128, 9\]"):
        check_metadata(stale, layout, torch.tensor([10, 127, 5]))
    with pytest.raises(ValueError, match="request 2 writes positions up to 128 but its block table row holds 1 pages"):
        attn.plan(layout, [10, 5, 125], table)
    attn.plan(layout, [10, 5, 3], table, metadata=AscendVerifyMetadata.from_layout(layout, [10, 5, 3], ()))
    with pytest.raises(ValueError, match=r"q must be \[7, 4, 16\] \(the planned metadata's rows\), got \[8, 4, 16\]"):
        attn.run(torch.randn(8, 4, D), *_cache(4, 2, 0))
    with pytest.raises(TypeError, match="op must be the fused infer attention operator"):
        NpuVerifyAttention(AttentionShape(16, 4, 2, 4, 2, D, PAGE), "cpu", torch.float32, op="fia")


def test_backend_without_torch_npu_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from dspark.ascend.runtime import NpuUnavailableError

    monkeypatch.setitem(sys.modules, "torch_npu", None)
    layout = RaggedVerifyLayout.from_verify_lens([1])
    attn = NpuVerifyAttention(AttentionShape(4, 1, 1, 4, 2, D, PAGE), "cpu", torch.float32)
    attn.plan(layout, [3], torch.tensor([[1]], dtype=torch.int32))
    with pytest.raises(NpuUnavailableError, match=r"pip install dspark\[npu\]"):
        attn.run(torch.randn(1, 4, D), *_cache(2, 2, 0))
