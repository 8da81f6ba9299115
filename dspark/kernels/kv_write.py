"""Store the verify rows' K/V into a paged cache at flat slots `page * page_size + offset`.

Rows whose slot is negative (padding rows of ghost slots) write nothing. Triton kernel + torch reference.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.kernels import compare as cmp
from dspark.kernels import dispatch
from dspark.kernels._triton import jit, tl, triton


def write_kv_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_slots: Tensor) -> None:
    """Torch reference: `cache[slot // page_size, slot % page_size] = row` for every row with slot >= 0.

    One index of the kept rows, then one `index_put_` per cache (no boolean-mask indexing of k / v).
    """
    page_size = k_cache.shape[1]
    keep = (kv_slots >= 0).nonzero().squeeze(1).to(k.device)
    slots = kv_slots.to(k.device, torch.int64).index_select(0, keep)
    where = (slots // page_size, slots % page_size)
    k_cache.index_put_(where, k.index_select(0, keep).to(k_cache.dtype))
    v_cache.index_put_(where, v.index_select(0, keep).to(v_cache.dtype))


@dispatch.kernel_kind("vector")
@jit(do_not_specialize=("n_rows", "n_items"))
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, n_rows, n_items, num_heads, head_dim, page_size,
    stride_kr, stride_kh, stride_kd, stride_vr, stride_vh, stride_vd,
    stride_kcp, stride_kco, stride_kch, stride_kcd, stride_vcp, stride_vco, stride_vch, stride_vcd,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP32: tl.constexpr = False,
):
    # One work item = BLOCK_R rows; the columns flatten (head, dim) so any cache strides work. FP32: the row
    # mask and the slot test in exact fp32 (`compare`; slots stay below the cache's size).
    offs_c = tl.arange(0, BLOCK_H * BLOCK_D)
    h = (offs_c // BLOCK_D).to(tl.int64)
    d = (offs_c % BLOCK_D).to(tl.int64)
    col_ok = (h < num_heads) & (d < head_dim)
    k_cols = h * stride_kh + d * stride_kd
    v_cols = h * stride_vh + d * stride_vd
    kc_cols = h * stride_kch + d * stride_kcd
    vc_cols = h * stride_vch + d * stride_vcd
    for item in tl.range(tl.program_id(0), n_items, tl.num_programs(0)):
        rows = tl.cast(item, tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        slot = tl.load(slots_ptr + rows, mask=cmp.lt(rows, n_rows, FP32), other=-1).to(tl.int64)
        ok = cmp.le(0, slot, FP32)[:, None] & col_ok[None, :]
        dst = (slot // page_size)[:, None]
        off = (slot % page_size)[:, None]
        k = tl.load(k_ptr + rows[:, None] * stride_kr + k_cols[None, :], mask=ok)
        v = tl.load(v_ptr + rows[:, None] * stride_vr + v_cols[None, :], mask=ok)
        tl.store(kc_ptr + dst * stride_kcp + off * stride_kco + kc_cols[None, :], k.to(kc_ptr.dtype.element_ty),
                 mask=ok)
        tl.store(vc_ptr + dst * stride_vcp + off * stride_vco + vc_cols[None, :], v.to(vc_ptr.dtype.element_ty),
                 mask=ok)


def write_kv_triton(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_slots: Tensor) -> None:
    """Triton launcher: persistent work items of up to 16 rows (fewer when a row is wide)."""
    rows, heads, dim = k.shape
    if rows == 0:
        return
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(dim)
    block_r = max(1, min(16, 4096 // (block_h * block_d)))
    n_items = triton.cdiv(rows, block_r)
    _write_kv_kernel[dispatch.grid(n_items, k.device, _write_kv_kernel)](
        k, v, k_cache, v_cache, kv_slots, rows, n_items, heads, dim, k_cache.shape[1],
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_D=block_d,
        FP32=dispatch.fp32_compares(k.device, max(rows + block_r, k_cache.shape[0] * k_cache.shape[1])),
    )


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_slots: Tensor) -> None:
    """Dispatching entry point for the cache write (inputs checked by `dspark.verify.attention.write_kv`)."""
    if dispatch.use_triton(k, k_cache):
        write_kv_triton(k, v, k_cache, v_cache, kv_slots)
    else:
        write_kv_ref(k, v, k_cache, v_cache, kv_slots)
