"""Ragged TARGET_VERIFY metadata for Ascend: worked example, static reference, brute force, bad input."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.ascend import AscendVerifyMetadata
from dspark.verify.layout import RaggedVerifyLayout, round_up_to_tier

LIVE = [10, 127, 255]


def _meta(device, verify_lens, live, **layout_kw):
    lens = torch.tensor(verify_lens, dtype=torch.int32, device=device)
    layout = RaggedVerifyLayout.from_verify_lens(lens, **layout_kw)
    return layout, AscendVerifyMetadata.from_layout(layout, torch.tensor(live, dtype=torch.int64, device=device))


def _l(t: torch.Tensor) -> list:
    return t.cpu().tolist()


def test_worked_example_eager(device):
    _, m = _meta(device, [2, 1, 4], LIVE)
    assert _l(m.cu_seqlens_q) == m.cu_seqlens_q_host == [0, 2, 3, 7]
    assert _l(m.actual_seq_lengths_q) == m.actual_seq_lengths_q_host == [2, 3, 7]
    assert m.max_seqlen_q == m.max_input_capacity == 4
    assert _l(m.positions) == [10, 11, 127, 255, 256, 257, 258]
    assert _l(m.seq_lens_kv) == m.seq_lens_kv_host == [12, 128, 259]
    assert m.max_seq_len_kv == 259 and m.block_table_width(128) == 3
    assert _l(m.start_pos) == LIVE and _l(m.seqused) == [2, 1, 4]
    c4, c128 = m.compressed[4], m.compressed[128]
    assert c4.padding_size == 4 and _l(c4.positions) == [8, 124, 252, 0]
    assert _l(c4.rows) == [1, 2, 3, 0] and _l(c4.valid) == [True, True, True, False]
    assert c128.padding_size == 3 and _l(c128.positions) == [0, 128, 0]
    assert _l(c128.rows) == [2, 3, 0] and _l(c128.valid) == [True, True, False]
    assert _l(c128.interval_start) == [0, 0, 1] and _l(c128.interval_end) == [0, 1, 2]
    assert _l(c128.indices) == [0, 1, 0]


def test_worked_example_graph_tier(device):
    layout, m = _meta(device, [2, 1, 4], LIVE, tiers=[8], graph_slots=8, width=4)
    assert (m.tier, m.num_tokens, m.num_slots, m.num_requests) == (8, 8, 8, 3)
    assert _l(layout.slot_lens) == [2, 1, 4, 1, 0, 0, 0, 0]
    assert m.cu_seqlens_q_host == [0, 2, 3, 7, 8, 8, 8, 8, 8] == _l(m.cu_seqlens_q)
    assert _l(m.seqused) == [2, 1, 4, 0, 0, 0, 0, 0]
    assert _l(m.seq_lens_kv) == [12, 128, 259, 1, 1, 1, 1, 1]
    assert _l(m.start_pos) == [10, 127, 255, 0, 0, 0, 0, 0]
    assert _l(m.positions)[7] == 0 and _l(m.row_valid) == [True] * 7 + [False]
    assert m.max_seqlen_q == 4
    locs = torch.arange(100, 108, device=device)
    assert _l(m.write_locs(locs)) == [100, 101, 102, 103, 104, 105, 106, 0]
    c4 = m.compressed[4]
    assert c4.padding_size == 8 and _l(c4.positions) == [8, 124, 252, 0, 0, 0, 0, 0]
    assert _l(c4.valid) == [True] * 3 + [False] * 5


def test_static_reference(device):
    m = AscendVerifyMetadata.from_static(torch.tensor(LIVE, device=device), 4)
    assert _l(m.cu_seqlens_q) == [0, 4, 8, 12] and m.actual_seq_lengths_q_host == [4, 8, 12]
    assert _l(m.seq_lens_kv) == [14, 131, 259] and _l(m.seqused) == [4, 4, 4]
    assert m.compressed[4].padding_size == 6 and _l(m.compressed[4].positions) == [8, 124, 252, 0, 0, 0]
    assert _l(m.compressed[128].positions) == [0, 128, 0]


def test_extra_slots_are_ghosts(device):
    layout, _ = _meta(device, [3, 1], [5, 8])
    m = AscendVerifyMetadata.from_layout(layout, [5, 8], slots=4)
    assert m.cu_seqlens_q_host == [0, 3, 4, 4, 4] and _l(m.seq_lens_kv) == [8, 9, 1, 1]
    assert _l(m.seqused) == [3, 1, 0, 0] and _l(m.compressed[4].interval_end) == [2, 2, 0, 0]


def _brute_force(verify_lens, live, r):
    """Per-row enumeration: (position, packed row, request) of every group completed by a verified row."""
    out, row = [], 0
    for i, (v, L) in enumerate(zip(verify_lens, live)):
        for j in range(1, v + 1):
            if (L + j) % r == 0:
                out.append((L + j - r, row + j - 1, i))
        row += v
    return out


@st.composite
def ragged_case(draw, min_b=0):
    width = draw(st.integers(1, 9))
    b = draw(st.integers(min_b, 6))
    lens = draw(st.lists(st.integers(1, width), min_size=b, max_size=b))
    live = draw(st.lists(st.integers(0, 300), min_size=b, max_size=b))
    ratios = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 7, 128]), min_size=1, max_size=3, unique=True)))
    kw = {"width": width}
    if draw(st.booleans()):
        kw["tiers"] = sorted(set(draw(st.lists(st.integers(1, 60), min_size=1, max_size=3))))
        tier = round_up_to_tier(sum(lens), kw["tiers"])
        padding = 0 if tier is None else tier - sum(lens)
        # enough ghost slots for the padding (at most W rows each), so every draw is a valid layout
        kw["graph_slots"] = b + max(1, -(-padding // width)) + draw(st.integers(0, 11))
    kw["extra_slots"] = draw(st.integers(0, 2))
    return lens, live, ratios, kw


@given(ragged_case())
@settings(max_examples=60)
def test_compressed_entries_are_exactly_the_completed_groups(device, case):
    lens, live, ratios, kw = case
    extra = kw.pop("extra_slots")
    lt = torch.tensor(lens, dtype=torch.int32, device=device)
    layout = RaggedVerifyLayout.from_verify_lens(lt, **kw)
    m = AscendVerifyMetadata.from_layout(layout, torch.tensor(live, dtype=torch.int64, device=device), ratios,
                                         slots=layout.num_slots + extra)
    b, s, t = len(lens), m.num_slots, m.num_tokens
    ghosts = s - b
    assert m.cu_seqlens_q_host[: b + 1] == [sum(lens[:i]) for i in range(b + 1)]
    assert m.cu_seqlens_q_host[-1] == t and _l(m.cu_seqlens_q) == m.cu_seqlens_q_host
    assert _l(m.seq_lens_kv) == [L + v for L, v in zip(live, lens)] + [1] * ghosts
    assert _l(m.seqused) == lens + [0] * ghosts and _l(m.start_pos) == live + [0] * ghosts
    assert _l(m.positions) == [L + j for L, v in zip(live, lens) for j in range(v)] + [0] * (t - sum(lens))
    for r in ratios:
        g, want = m.compressed[r], _brute_force(lens, live, r)
        n = len(want)
        assert g.padding_size == max(1, min(t, t // r + s)) >= n
        got = list(zip(_l(g.positions), _l(g.rows), _l(g.slots)))
        assert got[:n] == want and got[n:] == [(0, 0, 0)] * (g.padding_size - n)
        assert _l(g.valid) == [True] * n + [False] * (g.padding_size - n)
        assert _l(g.interval_start) == [L // r for L in live] + [0] * ghosts
        assert _l(g.interval_end) == [(L + v) // r for L, v in zip(live, lens)] + [0] * ghosts


@given(st.integers(1, 6), st.integers(1, 8), st.lists(st.integers(0, 400), min_size=6, max_size=6),
       st.lists(st.sampled_from([1, 2, 3, 4, 5, 128]), min_size=1, max_size=3, unique=True))
def test_uniform_lengths_reproduce_static(device, b, n, live, ratios):
    live_t = torch.tensor(live[:b], device=device)
    layout = RaggedVerifyLayout.from_verify_lens(torch.full((b,), n, dtype=torch.int32, device=device))
    ragged = AscendVerifyMetadata.from_layout(layout, live_t, ratios)
    assert ragged.diff(AscendVerifyMetadata.from_static(live_t, n, ratios)) == []


@given(ragged_case(min_b=1))
def test_ragged_entries_are_static_entries_inside_verified_rows(device, case):
    lens, live, ratios, kw = case
    n = kw["width"]
    layout = RaggedVerifyLayout.from_verify_lens(torch.tensor(lens, dtype=torch.int32, device=device))
    ragged = AscendVerifyMetadata.from_layout(layout, torch.tensor(live, device=device), ratios)
    static = AscendVerifyMetadata.from_static(torch.tensor(live, device=device), n, ratios)
    for r in ratios:
        rg, sg = ragged.compressed[r], static.compressed[r]
        keep = [(p, s) for p, row, s, ok in zip(_l(sg.positions), _l(sg.rows), _l(sg.slots), _l(sg.valid))
                if ok and row % n < lens[s]]
        assert keep == [(p, s) for p, s, ok in zip(_l(rg.positions), _l(rg.slots), _l(rg.valid)) if ok]


def test_diff_names_fields(device):
    _, a = _meta(device, [2, 1, 4], LIVE)
    _, b = _meta(device, [2, 1, 4], [10, 127, 256])
    assert {"seq_lens_kv", "start_pos", "positions", "compressed[4].positions"} <= set(a.diff(b))


def test_bad_input(device):
    layout, _ = _meta(device, [2, 1], [4, 4])
    with pytest.raises(TypeError, match=r"layout must be a RaggedVerifyLayout, got list: \[2, 1\]"):
        AscendVerifyMetadata.from_layout([2, 1], [4, 4])
    with pytest.raises(ValueError, match="3 entries but the layout has 2"):
        AscendVerifyMetadata.from_layout(layout, [1, 2, 3])
    with pytest.raises(ValueError, match=r"live_seq_lens\[1\] = -5"):
        AscendVerifyMetadata.from_layout(layout, [1, -5])
    with pytest.raises(TypeError, match="float32"):
        AscendVerifyMetadata.from_layout(layout, torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="ints"):
        AscendVerifyMetadata.from_layout(layout, [1, 2.5])
    for bad in [(4, 0), (-4,), (4, 4), (True,), (2.0,)]:
        with pytest.raises(ValueError, match="compress_ratios"):
            AscendVerifyMetadata.from_layout(layout, [1, 2], bad)
    with pytest.raises(ValueError, match="slots must be"):
        AscendVerifyMetadata.from_layout(layout, [1, 2], slots=1)
    graph = RaggedVerifyLayout.from_verify_lens([2, 1], tiers=[4])
    with pytest.raises(ValueError, match="width"):
        AscendVerifyMetadata.from_layout(graph, [1, 2])
    with pytest.raises(ValueError, match="draft_token_num"):
        AscendVerifyMetadata.from_static([1, 2], 0)
    with pytest.raises(ValueError, match="overflows int32"):
        AscendVerifyMetadata.from_static([2**31 - 2], 4)
    with pytest.raises(ValueError, match="overflows int32"):
        AscendVerifyMetadata.from_layout(layout, [1, 2**31 - 1])
    with pytest.raises(ValueError, match=r"live_seq_lens\[0\] = -1"):
        AscendVerifyMetadata.from_static(torch.tensor([-1, 3]), 4)
    m = AscendVerifyMetadata.from_layout(layout, [1, 2])
    with pytest.raises(ValueError, match="page_size"):
        m.block_table_width(0)
    with pytest.raises(ValueError, match="out_cache_loc must be"):
        m.write_locs(torch.zeros(5, dtype=torch.int64))


def test_compressed_locs(device):
    _, m = _meta(device, [2, 1, 4], LIVE)
    table = torch.arange(3 * 70, device=device).reshape(3, 70) + 1000   # slot s, index c -> 1000 + 70 s + c
    assert _l(m.compressed_locs(4, table)) == [1002, 1101, 1203, 0]
    assert _l(m.compressed_locs(128, table)) == [1070, 1141, 0]
    with pytest.raises(ValueError, match="page_table must be"):
        m.compressed_locs(4, table[:2])
    with pytest.raises(ValueError, match="needs index 63"):
        m.compressed_locs(4, table[:, :10])
    with pytest.raises(ValueError, match="compress_ratios"):
        m.compressed_locs(8, table)
    _, empty = _meta(device, [], [])
    assert _l(empty.compressed_locs(4, torch.zeros(0, 3, dtype=torch.int64, device=device))) == [0]
    _, none_done = _meta(device, [1], [0])
    assert _l(none_done.compressed_locs(4, torch.zeros(1, 0, dtype=torch.int64, device=device))) == [0]
