"""The compressed-KV path: a reference C4 / C128 compressor writes at the rows `AscendVerifyMetadata` names for
ragged (and tier-padded) verify rows, and after the same committed tokens its state equals the static path's
and a brute-force pooling of the committed features (the seed's "C4/C128 write positions consistent with the
ragged rows")."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.ascend.compressor import ReferenceCompressor
from dspark.ascend.metadata import AscendVerifyMetadata
from dspark.verify.layout import RaggedVerifyLayout

pytestmark = pytest.mark.cpu_only(reason="host-side reference compressor over CPU metadata")

N = 4          # static width
DIM = 3


def feature(req: int, pos: int, token: int) -> torch.Tensor:
    """A row's feature: a function of (request, position, token), so wrong drafts give other features."""
    x = torch.tensor([req * 0.37 + pos * 0.11 + token * 1.3], dtype=torch.float64)
    return torch.cat([torch.sin(x), torch.cos(2 * x), torch.sin(3 * x + 1)]).float()


def brute_force_rows(live: list[int], lens: list[int], r: int) -> list[tuple[int, int, int]]:
    """(slot, packed row, group start) of every group completed inside the verified rows, request-major."""
    out, row = [], 0
    for i, (length, v) in enumerate(zip(live, lens)):
        for j in range(1, v + 1):
            if (length + j) % r == 0:
                out.append((i, row + j - 1, length + j - r))
        row += v
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5).flatmap(lambda b: st.tuples(
    st.lists(st.integers(1, N), min_size=b, max_size=b), st.lists(st.integers(0, 300), min_size=b, max_size=b),
    st.sampled_from([4, 128]), st.sampled_from([None, (8, 16, 24)]))))
def test_write_rows_equal_brute_force(case) -> None:
    lens, live, r, tiers = case
    layout = RaggedVerifyLayout.from_verify_lens(lens, tiers=tiers, graph_slots=len(lens) + 6 if tiers else None,
                                                 width=N)
    g = AscendVerifyMetadata.from_layout(layout, live, (r,)).compressed[r]
    got = [(s, row, p) for s, row, p, ok in zip(g.slots.tolist(), g.rows.tolist(), g.positions.tolist(),
                                                 g.valid.tolist()) if ok]
    assert got == brute_force_rows(live, lens, r)
    assert not g.valid[len(got):].any() and g.valid[: len(got)].all()


def _run(prompts: list[int], steps: list[tuple[list[int], list[int]]], r: int, static: bool,
         tiers: tuple[int, ...] | None, truth: torch.Tensor) -> tuple[ReferenceCompressor, list[int]]:
    """Prefill then verify steps; `steps` = (verify lens, commit lens) per step; returns the compressor and the
    committed lengths. Row j < commit carries the true token, later rows a wrong draft."""
    b = len(prompts)
    comp = ReferenceCompressor(r, b, truth.shape[1], DIM)
    ids = torch.arange(b)
    pre = RaggedVerifyLayout.from_verify_lens([p - 1 for p in prompts])
    meta = AscendVerifyMetadata.from_layout(pre, [0] * b, (r,))
    rows = torch.stack([feature(i, p, int(truth[i, p])) for i, p in _row_owners(meta, [p - 1 for p in prompts])])
    comp.write(meta, rows, ids)
    length = [p - 1 for p in prompts]                       # cached tokens (the root is not cached yet)
    for lens, commits in steps:
        if static:
            meta = AscendVerifyMetadata.from_static(length, N, (r,))
            verified = [N] * b
        else:
            layout = RaggedVerifyLayout.from_verify_lens(lens, tiers=tiers, graph_slots=b + 6 if tiers else None,
                                                         width=N)
            meta = AscendVerifyMetadata.from_layout(layout, length, (r,))
            verified = lens
        feats = torch.zeros(meta.num_tokens, DIM)
        for row, (i, p) in zip(range(meta.num_tokens), _row_owners(meta, verified)):
            j = p - length[i]
            token = int(truth[i, p]) if j < commits[i] else int(truth[i, p]) + 1   # rejected drafts differ
            feats[row] = feature(i, p, token)
        comp.write(meta, feats, ids)
        length = [x + c for x, c in zip(length, commits)]
    return comp, length


def _row_owners(meta: AscendVerifyMetadata, lens: list[int]) -> list[tuple[int, int]]:
    """(request, position) of the real rows, in packed order."""
    pos = meta.positions.tolist()
    out, row = [], 0
    for i, v in enumerate(lens):
        out += [(i, pos[row + j]) for j in range(v)]
        row = meta.cu_seqlens_q_host[i + 1]
    return out


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3).flatmap(lambda b: st.tuples(
    st.lists(st.integers(2, 140), min_size=b, max_size=b),
    st.lists(st.lists(st.tuples(st.integers(1, N), st.integers(1, N)), min_size=b, max_size=b), min_size=1,
             max_size=6),
    st.sampled_from([4, 128]), st.sampled_from([None, (8, 16)]), st.integers(0, 2**16))))
def test_compact_state_equals_static_and_brute_force_after_the_same_commits(case) -> None:
    prompts, raw, r, tiers, seed = case
    steps = [([v for v, _ in step], [min(c, v) for v, c in step]) for step in raw]   # commit <= verify length
    truth = torch.randint(0, 50, (len(prompts), 200), generator=torch.Generator().manual_seed(seed))
    compact, length = _run(prompts, steps, r, False, tiers, truth)
    static, static_length = _run(prompts, steps, r, True, None, truth)
    assert length == static_length
    for i, n in enumerate(length):
        done = n // r                                       # groups inside the committed tokens
        want = torch.stack([torch.stack([feature(i, p, int(truth[i, p])) for p in range(gi * r, gi * r + r)]).mean(0)
                            for gi in range(done)]) if done else torch.zeros(0, DIM)
        torch.testing.assert_close(compact.entries[i, :done], want)
        torch.testing.assert_close(static.entries[i, :done], want)


def test_entries_naming_a_wrong_row_are_refused() -> None:
    layout = RaggedVerifyLayout.from_verify_lens([2, 1, 4])
    meta = AscendVerifyMetadata.from_layout(layout, [10, 127, 255], (4,))
    comp = ReferenceCompressor(4, 3, 300, DIM)
    assert comp.write(meta, torch.randn(7, DIM), torch.arange(3)).tolist() == [[0, 2], [1, 31], [2, 63]]
    static = AscendVerifyMetadata.from_static([10, 127, 255], 4, (4,))     # rows at stride 4: not this layout's
    wrong = dataclasses.replace(meta, compressed=static.compressed)
    with pytest.raises(ValueError, match=r"C4 entries name rows \[1, 4, 8\] past the 7 packed rows"):
        comp.write(wrong, torch.randn(7, DIM), torch.arange(3))
    shifted = dataclasses.replace(meta, positions=meta.positions + 1)          # rows of other positions
    with pytest.raises(ValueError, match="C4 entries name rows that do not end their groups"):
        comp.write(shifted, torch.randn(7, DIM), torch.arange(3))
    with pytest.raises(ValueError, match=r"rows must be \[7, 3\], got \[8, 3\]"):
        comp.write(meta, torch.randn(8, DIM), torch.arange(3))
    with pytest.raises(ValueError, match=r"metadata has no ratio 128 entries"):
        ReferenceCompressor(128, 3, 300, DIM).write(meta, torch.randn(7, DIM), torch.arange(3))
