"""Layout kernels: qo_indptr, per-row maps, pack and scatter, with their torch references.

Rows of the packed verify batch are request-major: request r owns rows
`[qo_indptr[r], qo_indptr[r + 1])`; rows past the real total belong to ghost slots (padding).

Each Triton kernel loops persistently over its work items (`dispatch.grid`), writes every element of
its output exactly once (tests poison outputs first) and has no batch-size ceiling: the prefix sum is a
blocked scan with a carried prefix inside one persistent program.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from dspark.kernels import compare as cmp
from dspark.kernels import dispatch
from dspark.kernels._triton import jit, tl, triton

SCAN_BLOCK = 1024   # lengths summed per step of the carried-prefix scan
ROW_BLOCK = 128     # packed rows mapped per work item


# ---------------------------------------------------------------- qo_indptr

def qo_indptr_ref(lens: Tensor) -> Tensor:
    """`[0, cumsum(lens)]` as int32."""
    out = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    out[1:] = torch.cumsum(lens.to(torch.int64), 0).to(torch.int32)
    return out


@dispatch.kernel_kind("vector")
@jit(do_not_specialize=("n",))
def _qo_indptr_kernel(lens_ptr, out_ptr, n, BLOCK: tl.constexpr, FP32: tl.constexpr = False):
    # One work item: the whole scan, block by block with the running prefix carried in a register.
    for _item in tl.range(tl.program_id(0), 1, tl.num_programs(0)):
        tl.store(out_ptr, 0)
        prefix = tl.zeros([], dtype=tl.int32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = cmp.lt(offs, n, FP32)
            x = tl.load(lens_ptr + offs, mask=ok, other=0).to(tl.int32)
            tl.store(out_ptr + 1 + offs, prefix + tl.cumsum(x, 0), mask=ok)
            prefix += tl.sum(x, 0)


def qo_indptr_triton(lens: Tensor, out: Tensor) -> Tensor:
    """Triton `qo_indptr` into `out` ([n+1] int32)."""
    _qo_indptr_kernel[dispatch.grid(1, lens.device, _qo_indptr_kernel)](
        lens, out, lens.numel(), BLOCK=SCAN_BLOCK, FP32=dispatch.fp32_compares(lens.device, lens.numel() + SCAN_BLOCK))
    return out


def qo_indptr(lens: Tensor) -> Tensor:
    """`[0, cumsum(lens)]` int32: Triton on accelerators, the torch reference elsewhere (CPU, torch.compile)."""
    if not dispatch.use_kernel(lens):
        return qo_indptr_ref(lens)
    return qo_indptr_triton(lens, torch.empty(lens.numel() + 1, dtype=torch.int32, device=lens.device))


# ---------------------------------------------------------------- row maps

def row_maps_ref(slot_lens: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """(row_slot, row_within) int32 [num_rows] for slots of the given lengths (lengths sum to num_rows)."""
    device = slot_lens.device
    slots = torch.arange(slot_lens.numel(), dtype=torch.int32, device=device)
    row_slot = torch.repeat_interleave(slots, slot_lens.to(torch.int64), output_size=num_rows)
    starts = qo_indptr_ref(slot_lens)[:-1]
    rows = torch.arange(num_rows, dtype=torch.int32, device=device)
    row_within = rows - starts.index_select(0, row_slot.to(torch.int64))
    return row_slot, row_within.to(torch.int32)


def slot_maps_host(slot_lens: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slot_qo_indptr [S+1], row_slot [num_rows], row_within [num_rows]) int32 from host slot lengths that
    sum to num_rows: `qo_indptr` + `row_maps` in one numpy pass, the CPU path for per-step layouts (a
    few numpy calls instead of a chain of torch ops, each with microseconds of dispatch)."""
    indptr = np.zeros(slot_lens.size + 1, dtype=np.int32)
    np.cumsum(slot_lens, out=indptr[1:])
    row_slot = np.repeat(np.arange(slot_lens.size, dtype=np.int32), slot_lens)
    row_within = np.arange(num_rows, dtype=np.int32) - indptr[row_slot]
    return indptr, row_slot, row_within


@dispatch.kernel_kind("vector")
@jit(do_not_specialize=("num_slots", "num_rows", "search_steps"))
def _row_maps_kernel(slot_indptr_ptr, row_slot_ptr, row_within_ptr, num_slots, num_rows, search_steps,
                     BLOCK: tl.constexpr, FP32: tl.constexpr = False):
    # One work item per block of rows: each row's slot is the last s with slot_indptr[s] <= row, found
    # by a branch-free binary search (invariant: indptr[lo] <= row < indptr[hi], indptr[S + 1] = inf).
    for blk in tl.range(tl.program_id(0), tl.cdiv(num_rows, BLOCK), tl.num_programs(0)):
        rows = blk * BLOCK + tl.arange(0, BLOCK)
        m = cmp.lt(rows, num_rows, FP32)
        lo = tl.zeros([BLOCK], dtype=tl.int32)
        hi = tl.zeros([BLOCK], dtype=tl.int32) + num_slots + 1
        for _ in range(search_steps):
            mid = (lo + hi) // 2
            below = cmp.le(tl.load(slot_indptr_ptr + mid, mask=m, other=0), rows, FP32)  # mid <= S: mid < hi
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid)
        tl.store(row_slot_ptr + rows, lo, mask=m)
        tl.store(row_within_ptr + rows, rows - tl.load(slot_indptr_ptr + lo, mask=m, other=0), mask=m)


def row_maps_triton(slot_lens: Tensor, row_slot: Tensor, row_within: Tensor) -> tuple[Tensor, Tensor]:
    """Triton row maps into `row_slot` / `row_within` (int32 [sum(slot_lens)])."""
    n, rows = slot_lens.numel(), row_slot.numel()
    if n and rows:
        indptr = qo_indptr_triton(slot_lens, torch.empty(n + 1, dtype=torch.int32, device=slot_lens.device))
        _row_maps_kernel[dispatch.grid(triton.cdiv(rows, ROW_BLOCK), slot_lens.device, _row_maps_kernel)](
            indptr, row_slot, row_within, n, rows, (n + 1).bit_length(), BLOCK=ROW_BLOCK,
            FP32=dispatch.fp32_compares(slot_lens.device, rows + ROW_BLOCK))
    return row_slot, row_within


def row_maps(slot_lens: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """(row_slot, row_within) int32 [num_rows]: Triton on accelerators, the torch reference elsewhere (CPU,
    torch.compile)."""
    if not dispatch.use_kernel(slot_lens):
        return row_maps_ref(slot_lens, num_rows)
    empty = lambda: torch.empty(num_rows, dtype=torch.int32, device=slot_lens.device)  # noqa: E731
    return row_maps_triton(slot_lens, empty(), empty())


# ---------------------------------------------------------------- pack / scatter

def pack_ref(strided: Tensor, row_slot: Tensor, row_within: Tensor, num_real_rows: int, fill: float) -> Tensor:
    """`[B, W, ...] -> [rows, ...]`: packed row i = strided[row_slot[i], row_within[i]]; padding = fill."""
    b, w = strided.shape[:2]
    rows = row_slot.numel()
    out = torch.full((rows, *strided.shape[2:]), fill, dtype=strided.dtype, device=strided.device)
    if b == 0 or num_real_rows == 0:
        return out
    src = row_slot[:num_real_rows].to(torch.int64) * w + row_within[:num_real_rows].to(torch.int64)
    out[:num_real_rows] = strided.reshape(b * w, *strided.shape[2:]).index_select(0, src)
    return out


def scatter_ref(packed: Tensor, qo_indptr: Tensor, width: int, num_real_rows: int, fill: float) -> Tensor:
    """`[rows, ...] -> [B, W, ...]`: the inverse of pack at real rows; positions never verified = fill."""
    b = qo_indptr.numel() - 1
    lens = (qo_indptr[1:] - qo_indptr[:-1]).to(torch.int64)
    valid = torch.arange(width, device=packed.device)[None, :] < lens[:, None]
    out = torch.full((b, width, *packed.shape[1:]), fill, dtype=packed.dtype, device=packed.device)
    out[valid] = packed[:num_real_rows]
    return out


@jit
def _copy_row(src_ptr, src_off, dst_row_ptr, d, valid, fill, BLOCK_D: tl.constexpr, FP32: tl.constexpr):
    """Copy one row of d elements when valid, else write fill."""
    src_d = tl.where(valid, d, 0)
    for d0 in range(0, d, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(src_ptr + src_off + offs, mask=cmp.lt(offs, src_d, FP32), other=fill)
        tl.store(dst_row_ptr + offs, x, mask=cmp.lt(offs, d, FP32))


@dispatch.kernel_kind("vector")
@jit(do_not_specialize=("rows", "num_real_rows"))
def _pack_kernel(src_ptr, dst_ptr, row_slot_ptr, row_within_ptr, rows, num_real_rows, d,
                 src_stride_b, src_stride_w, dst_stride, fill, BLOCK_D: tl.constexpr, FP32: tl.constexpr = False):
    # One work item per packed row: real rows copy strided[row_slot, row_within], padding rows = fill.
    for item in tl.range(tl.program_id(0), rows, tl.num_programs(0)):
        o = tl.cast(item, tl.int64)
        valid = cmp.lt(o, num_real_rows, FP32)
        a = tl.load(row_slot_ptr + o, mask=valid, other=0).to(tl.int64)
        b = tl.load(row_within_ptr + o, mask=valid, other=0).to(tl.int64)
        _copy_row(src_ptr, a * src_stride_b + b * src_stride_w, dst_ptr + o * dst_stride,
                  d, valid, fill, BLOCK_D, FP32)


@dispatch.kernel_kind("vector")
@jit(do_not_specialize=("cells",))
def _scatter_kernel(src_ptr, dst_ptr, qo_indptr_ptr, cells, width, d, src_stride, dst_stride, fill,
                    BLOCK_D: tl.constexpr, FP32: tl.constexpr = False):
    # One work item per (request r, position j): packed row qo_indptr[r] + j when j < len(r), else fill.
    for item in tl.range(tl.program_id(0), cells, tl.num_programs(0)):
        o = tl.cast(item, tl.int64)
        r = o // width
        j = o % width
        start = tl.load(qo_indptr_ptr + r)
        valid = cmp.lt(j, tl.load(qo_indptr_ptr + r + 1) - start, FP32)
        _copy_row(src_ptr, (start + j) * src_stride, dst_ptr + o * dst_stride,
                  d, valid, fill, BLOCK_D, FP32)


def _block_d(d: int) -> int:
    return max(16, min(1024, triton.next_power_of_2(max(d, 1))))


def _as_storage(t: Tensor) -> Tensor:
    """bool tensors travel as uint8 (same bytes)."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _fill_value(fill: float, dtype: torch.dtype) -> float | int:
    """The fill as the Python scalar type matching the tensor (ints stay exact)."""
    return float(fill) if dtype.is_floating_point else int(fill)


def pack_triton(strided: Tensor, row_slot: Tensor, row_within: Tensor, num_real_rows: int, fill: float,
                out: Tensor) -> Tensor:
    """Triton pack into `out` ([rows, ...]); every output row is written (padding rows = fill)."""
    rows = row_slot.numel()
    b, w = strided.shape[:2]
    src = _as_storage(strided).reshape(b, w, math.prod(strided.shape[2:]))
    if src.shape[2] and src.stride(2) != 1:
        src = src.contiguous()
    dst = _as_storage(out).view(rows, src.shape[2])
    d = dst.shape[1]
    if rows and d:
        _pack_kernel[dispatch.grid(rows, out.device, _pack_kernel)](
            src, dst, row_slot, row_within, rows, num_real_rows if b else 0, d, src.stride(0), src.stride(1),
            dst.stride(0), _fill_value(fill, out.dtype), BLOCK_D=_block_d(d),
            FP32=dispatch.fp32_compares(out.device, max(rows, d + _block_d(d))))
    return out


def scatter_triton(packed: Tensor, qo_indptr: Tensor, width: int, fill: float, out: Tensor) -> Tensor:
    """Triton scatter into `out` ([B, W, ...]); every output position is written (unverified = fill)."""
    b = qo_indptr.numel() - 1
    src = _as_storage(packed).reshape(packed.shape[0], math.prod(packed.shape[1:]))
    if src.shape[1] and src.stride(1) != 1:
        src = src.contiguous()
    dst = _as_storage(out).view(b * width, src.shape[1])
    d = dst.shape[1]
    if b * width and d:
        _scatter_kernel[dispatch.grid(b * width, out.device, _scatter_kernel)](
            src, dst, qo_indptr, b * width, width, d, src.stride(0), dst.stride(0),
            _fill_value(fill, out.dtype), BLOCK_D=_block_d(d),
            FP32=dispatch.fp32_compares(out.device, max(int(packed.shape[0]), d + _block_d(d))))
    return out


def pack(strided: Tensor, row_slot: Tensor, row_within: Tensor, num_real_rows: int, fill: float) -> Tensor:
    """`[B, W, ...] -> [rows, ...]`: Triton on accelerators, the torch reference elsewhere (CPU, torch.compile)."""
    if not dispatch.use_kernel(strided):
        return pack_ref(strided, row_slot, row_within, num_real_rows, fill)
    out = torch.empty((row_slot.numel(), *strided.shape[2:]), dtype=strided.dtype, device=strided.device)
    return pack_triton(strided, row_slot, row_within, num_real_rows, fill, out)


def scatter(packed: Tensor, qo_indptr: Tensor, width: int, num_real_rows: int, fill: float) -> Tensor:
    """`[rows, ...] -> [B, W, ...]`: Triton on accelerators, the torch reference elsewhere (CPU, torch.compile)."""
    if not dispatch.use_kernel(packed):
        return scatter_ref(packed, qo_indptr, width, num_real_rows, fill)
    out = torch.empty((qo_indptr.numel() - 1, width, *packed.shape[1:]), dtype=packed.dtype,
                      device=packed.device)
    return scatter_triton(packed, qo_indptr, width, fill, out)
