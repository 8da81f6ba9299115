"""Ragged TARGET_VERIFY metadata for the Ascend DSV4 attention and compressor path.

The static NPU verify path assumes one width N for every request (`actual_seq_lengths_q = [N, 2N, ..]`,
compressor positions from `live_seq_len + N`). `AscendVerifyMetadata.from_layout` computes every field
from a `RaggedVerifyLayout` instead (ascend.md section 3); `from_static` computes the static path's
fixed-width values by the fixed-width rule, so a uniform layout can be checked against it field for field.

Slots past the real requests are ghosts: `seqused = 0`, KV length 1, `start_pos = 0`, packed positions 0,
write slot 0. Two deliberate differences from the static path's formulas (ascend.md section 3):
- the compressed-entry buffers are `max(1, min(t, t // r + S))` with S slots where the static path uses B
  requests: a graph buffer must depend on the tier and the captured slots only (S = B when eager);
- `seqused = v` for every real request, also when L = 0; the static path masks with `L > 0` to spot
  padded batch entries, which here are explicit ghost slots.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from dspark.util.validate import check_int, check_type, int_tensor
from dspark.verify.layout import RaggedVerifyLayout

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class CompressedGroups:
    """Entries of one compression ratio r: one per group of r tokens completed inside the verified rows.

    For request i with live length L and verify length v, rows j in 1..v with (L + j) % r == 0 complete a
    group; the entry is the position `L + j - r` (= r * compressed index) produced at packed row
    `qo_indptr[i] + j - 1`. Entries are request-major, then by row; the tail up to `padding_size` is 0.
    """

    ratio: int
    padding_size: int       # P = max(1, min(t, t // r + S))
    positions: Tensor       # [P] int64, L + j - r; 0 in the tail
    rows: Tensor            # [P] int32, packed row completing the group; 0 in the tail
    slots: Tensor           # [P] int32, owning slot; 0 in the tail
    valid: Tensor           # [P] bool, True for real entries
    interval_start: Tensor  # [S] int32, L // r: first compressed index written this step (0 for ghosts)
    interval_end: Tensor    # [S] int32, (L + v) // r: one past the last (0 for ghosts)

    @property
    def indices(self) -> Tensor:
        """[P] int64 compressed cache index of each entry (positions // r)."""
        return self.positions // self.ratio


@dataclass(frozen=True)
class AscendVerifyMetadata:
    """Every TARGET_VERIFY input of the NPU DSV4 backend for one verify step (S slots, t packed rows)."""

    num_requests: int                # B real requests (slots B..S-1 are ghosts)
    num_slots: int                   # S, the kernel batch size
    num_tokens: int                  # t, packed rows the step runs (the tier in a graph)
    total_rows: int                  # sum of the real verify lengths
    tier: int | None                 # the graph tier, None when eager
    cu_seqlens_q: Tensor             # [S+1] int32 (actual_seq_lengths_q_pa), ends at t
    actual_seq_lengths_q: Tensor     # [S] int32 cumulative ends cu_seqlens_q[1:]
    cu_seqlens_q_host: list[int]     # host mirror for the task-update step (no D2H at replay)
    actual_seq_lengths_q_host: list[int]
    max_seqlen_q: int                # max verify length (eager) or the width bound W (graph)
    seq_lens_kv: Tensor              # [S] int32 final KV lengths L + v (ghosts 1)
    seq_lens_kv_host: list[int]
    max_seq_len_kv: int              # max final KV length: the block-table extent in tokens
    start_pos: Tensor                # [S] int32 compressor start position L (ghosts 0)
    seqused: Tensor                  # [S] int32 compressor valid rows v (ghosts 0)
    positions: Tensor                # [t] int64 packed row positions (padding rows 0)
    row_valid: Tensor                # [t] bool, False on padding rows
    compressed: dict[int, CompressedGroups]  # per compression ratio

    @property
    def max_input_capacity(self) -> int:
        """`dsv4_max_input_capacity`: bounds every slot's query rows."""
        return max(1, self.max_seqlen_q)

    def block_table_width(self, page_size: int) -> int:
        """Pages per request row of the block table (`ceil(max(L + v) / page_size)`)."""
        check_int("page_size", page_size, 1)
        return -(-self.max_seq_len_kv // page_size)

    def write_locs(self, out_cache_loc: Tensor) -> Tensor:
        """KV write slots per packed row with padding rows sent to the dummy slot 0."""
        if out_cache_loc.shape != (self.num_tokens,):
            raise ValueError(f"out_cache_loc must be [{self.num_tokens}], got {tuple(out_cache_loc.shape)}")
        return torch.where(self.row_valid, out_cache_loc, torch.zeros_like(out_cache_loc))

    def compressed_locs(self, ratio: int, page_table: Tensor) -> Tensor:
        """`c{r}_loc`: cache slot of every compressed entry, `page_table[slot, index]` from a per-slot
        compressed page table `[S, max_index]`; the tail is the dummy slot 0."""
        if ratio not in self.compressed:
            raise ValueError(f"ratio {ratio!r} is not one of the metadata's compress_ratios {list(self.compressed)}")
        g = self.compressed[ratio]
        if page_table.dim() != 2 or page_table.shape[0] != self.num_slots:
            raise ValueError(f"page_table must be [S={self.num_slots}, max_index], got {tuple(page_table.shape)}")
        idx = torch.where(g.valid, g.indices, torch.zeros_like(g.indices))
        need = int(idx.max()) + 1 if bool(g.valid.any()) else 0
        if need > page_table.shape[1]:
            raise ValueError(f"page_table has {page_table.shape[1]} columns; ratio {ratio} needs index {need - 1}")
        if need == 0:
            return torch.zeros_like(idx, dtype=page_table.dtype)
        locs = page_table[g.slots.to(torch.int64), idx]
        return torch.where(g.valid, locs, torch.zeros_like(locs))

    def diff(self, other: "AscendVerifyMetadata") -> list[str]:
        """Names of the fields that differ (tensors compared by dtype, shape and value)."""
        return _diff(self, other, "")

    @classmethod
    def from_layout(
        cls,
        layout: RaggedVerifyLayout,
        live_seq_lens: Tensor | Sequence[int],
        compress_ratios: Sequence[int] = (4, 128),
        slots: int | None = None,
    ) -> "AscendVerifyMetadata":
        """Ragged metadata. `live_seq_lens` [B]: KV length before this step; `slots`: kernel batch S
        (default the layout's slot count; extra slots are empty ghosts). A graph layout (tier set) must
        carry its width W, which bounds `max_seqlen_q` for every replay of the tier."""
        check_type("layout", layout, RaggedVerifyLayout)
        ratios = _check_ratios(compress_ratios)
        b, device = layout.num_requests, layout.qo_indptr.device
        live = _check_live(live_seq_lens, b, device)
        s = layout.num_slots if slots is None else slots
        if isinstance(s, bool) or not isinstance(s, int) or s < layout.num_slots:
            raise ValueError(f"slots must be an int >= the layout's {layout.num_slots} slots, got {slots!r}")
        if layout.tier is not None and layout.width is None:
            raise ValueError("a graph layout (tier set) needs its width W: build it with width=W")
        t, ext = layout.graph_num_tokens, s - layout.num_slots
        cu = torch.cat([layout.slot_qo_indptr, layout.slot_qo_indptr[-1:].expand(ext)])
        v = torch.zeros(s, dtype=torch.int64, device=device)
        v[:b] = layout.verify_lens.to(torch.int64)
        start = torch.zeros(s, dtype=torch.int64, device=device)
        start[:b] = live
        real = torch.arange(s, device=device) < b
        kv = torch.where(real, start + v, torch.ones_like(v))
        host = torch.cat([cu.to(torch.int64), kv, live]).tolist()  # the one D2H: host mirrors + checks
        cu_host, kv_host = host[: s + 1], host[s + 1: 2 * s + 1]
        _check_host(host[2 * s + 1:], kv_host)
        lens_host = [e - a for a, e in zip(cu_host, cu_host[1:])]
        bound = layout.width if layout.tier is not None else max(lens_host[:b], default=0)
        return cls(
            num_requests=b, num_slots=s, num_tokens=t, total_rows=layout.total_rows, tier=layout.tier,
            cu_seqlens_q=cu, actual_seq_lengths_q=cu[1:], cu_seqlens_q_host=cu_host,
            actual_seq_lengths_q_host=cu_host[1:], max_seqlen_q=bound,
            seq_lens_kv=kv.to(torch.int32), seq_lens_kv_host=kv_host, max_seq_len_kv=max(kv_host, default=0),
            start_pos=start.to(torch.int32),
            seqused=torch.cat([layout.seqused, layout.seqused.new_zeros(ext)]),
            positions=layout.positions(live), row_valid=layout.row_valid,
            compressed={r: _ragged_groups(r, start, v, cu, t) for r in ratios},
        )

    @classmethod
    def from_static(
        cls,
        live_seq_lens: Tensor | Sequence[int],
        draft_token_num: int,
        compress_ratios: Sequence[int] = (4, 128),
        device: torch.device | str | None = None,
    ) -> "AscendVerifyMetadata":
        """Today's fixed-width values: every request verifies N = draft_token_num rows at stride N."""
        n = check_int("draft_token_num", draft_token_num, 1)
        ratios = _check_ratios(compress_ratios)
        if device is None:
            device = live_seq_lens.device if isinstance(live_seq_lens, Tensor) else "cpu"
        live = _check_live(live_seq_lens, None, torch.device(device))
        b = live.numel()
        t = b * n
        cu = torch.arange(0, t + 1, n, dtype=torch.int32, device=live.device)
        kv = live + n
        live_host = live.tolist()  # the one D2H: host mirror + checks
        kv_host = [x + n for x in live_host]
        _check_host(live_host, kv_host)
        grid = live[:, None] + torch.arange(n, device=live.device)  # [B, N] positions
        return cls(
            num_requests=b, num_slots=b, num_tokens=t, total_rows=t, tier=None,
            cu_seqlens_q=cu, actual_seq_lengths_q=cu[1:], cu_seqlens_q_host=list(range(0, t + 1, n)),
            actual_seq_lengths_q_host=list(range(n, t + 1, n)), max_seqlen_q=n,
            seq_lens_kv=kv.to(torch.int32), seq_lens_kv_host=kv_host, max_seq_len_kv=max(kv_host, default=0),
            start_pos=live.to(torch.int32), seqused=torch.full((b,), n, dtype=torch.int32, device=live.device),
            positions=grid.reshape(-1), row_valid=torch.ones(t, dtype=torch.bool, device=live.device),
            compressed={r: _static_groups(r, grid) for r in ratios},
        )


def padding_size(ratio: int, num_tokens: int, num_slots: int) -> int:
    """Entries buffer size `max(1, min(t, t // r + S))`: completed groups <= sum ceil(v_i / r) <= t // r + S."""
    return max(1, min(num_tokens, num_tokens // ratio + num_slots))


def _ragged_groups(r: int, start: Tensor, v: Tensor, cu: Tensor, t: int) -> CompressedGroups:
    """Entries enumerated from the closed form: request i completes compressed indices [L//r, (L+v)//r)."""
    s, device = start.numel(), start.device
    lo, hi = start // r, (start + v) // r
    p = padding_size(r, t, s)
    e = torch.arange(p, device=device)
    if s == 0:
        return _groups(r, p, e, e, e, torch.zeros(p, dtype=torch.bool, device=device), lo, hi)
    ends = torch.cumsum(hi - lo, 0)
    first = ends - (hi - lo)                         # first entry of each slot
    # slot of entry e = (number of slots whose first entry is <= e) - 1: a prefix count, no search
    marks = torch.zeros(p + 1, dtype=torch.int32, device=device).index_add_(   # int32: NPU-friendly adds
        0, first.clamp(max=p), torch.ones(s, dtype=torch.int32, device=device))
    slot = torch.cumsum(marks[:p], 0, dtype=torch.int64) - 1
    c = lo[slot] + e - first[slot]                   # compressed index of entry e
    row = cu[slot].to(torch.int64) + r * (c + 1) - start[slot] - 1
    return _groups(r, p, r * c, row, slot, e < ends[-1], lo, hi)


def _static_groups(r: int, grid: Tensor) -> CompressedGroups:
    """Entries by the fixed-width rule: row (i, j) at flat index i*N + j completes a group when
    (position + 1) % r == 0; compacted in row order by a prefix count."""
    b, n = grid.shape
    t, device = b * n, grid.device
    p = padding_size(r, t, b)
    done = ((grid + 1) % r == 0).reshape(-1)
    dst = torch.where(done, torch.cumsum(done.to(torch.int64), 0) - 1, torch.full_like(grid.reshape(-1), p))
    flat = torch.arange(t, device=device)

    def compact(values: Tensor) -> Tensor:
        out = torch.zeros(p + 1, dtype=torch.int64, device=device)
        return out.scatter_(0, dst, values)[:p]

    valid = torch.zeros(p + 1, dtype=torch.bool, device=device).scatter_(0, dst, done)[:p]
    live = grid[:, 0]
    return _groups(r, p, compact(grid.reshape(-1) + 1 - r), compact(flat), compact(flat // n), valid,
                   live // r, (live + n) // r)


def _groups(r: int, p: int, positions: Tensor, rows: Tensor, slots: Tensor, valid: Tensor,
            lo: Tensor, hi: Tensor) -> CompressedGroups:
    zero = torch.zeros_like(positions)
    return CompressedGroups(
        ratio=r, padding_size=p,
        positions=torch.where(valid, positions, zero),
        rows=torch.where(valid, rows, zero).to(torch.int32),
        slots=torch.where(valid, slots, zero).to(torch.int32),
        valid=valid, interval_start=lo.to(torch.int32), interval_end=hi.to(torch.int32),
    )


def _check_ratios(ratios: Sequence[int]) -> tuple[int, ...]:
    out = tuple(ratios)
    for r in out:
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"compress_ratios must be positive ints, got {r!r} in {list(out)}")
    if len(set(out)) != len(out):
        raise ValueError(f"compress_ratios must be distinct, got {list(out)}")
    return out


def _check_live(live: Tensor | Sequence[int], b: int | None, device: torch.device) -> Tensor:
    """Live (pre-step) KV lengths as int64 [B] on `device` (values are checked on the host copy)."""
    out = int_tensor("live_seq_lens", live).to(device)
    if out.dim() != 1:
        raise ValueError(f"live_seq_lens must be 1-D [B], got shape {tuple(out.shape)}")
    if b is not None and out.numel() != b:
        raise ValueError(f"live_seq_lens has {out.numel()} entries but the layout has {b} requests")
    return out


def _check_host(live_host: list[int], kv_host: list[int]) -> None:
    """Reject negative live lengths and final KV lengths past int32 (host copies, no extra sync)."""
    for i, x in enumerate(live_host):
        if x < 0:
            raise ValueError(f"live_seq_lens[{i}] = {x} is negative")
    if kv_host and max(kv_host) > INT32_MAX:
        raise ValueError(f"final KV length {max(kv_host)} overflows int32")


def _diff(a: object, b: object, prefix: str) -> list[str]:
    out: list[str] = []
    for f in dataclasses.fields(a):
        x, y, name = getattr(a, f.name), getattr(b, f.name), prefix + f.name
        if isinstance(x, Tensor):
            same = isinstance(y, Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y.to(x.device))
            out += [] if same else [name]
        elif isinstance(x, dict):
            if x.keys() != y.keys():
                out.append(name)
            else:
                out += [d for k in x for d in _diff(x[k], y[k], f"{name}[{k}].")]
        elif x != y:
            out.append(name)
    return out
