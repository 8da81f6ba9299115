"""Store the verify rows' K/V into a paged cache at flat slots `page * page_size + offset`.

Rows whose slot is negative (padding rows of ghost slots) write nothing. Triton kernel + torch reference.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from dspark.kernels import dispatch


def write_kv_ref(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_slots: Tensor) -> None:
    """Torch reference: `cache[slot // page_size, slot % page_size] = row` for every row with slot >= 0."""
    page_size = k_cache.shape[1]
    keep = kv_slots >= 0
    slots = kv_slots[keep].to(k.device).long()
    k_cache[slots // page_size, slots % page_size] = k[keep].to(k_cache.dtype)
    v_cache[slots // page_size, slots % page_size] = v[keep].to(v_cache.dtype)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, n_rows, num_heads, head_dim, page_size,
    stride_kr, stride_kh, stride_kd, stride_vr, stride_vh, stride_vd,
    stride_kcp, stride_kco, stride_kch, stride_kcd, stride_vcp, stride_vco, stride_vch, stride_vcd,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    tile_ok = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        slot = tl.load(slots_ptr + row).to(tl.int64)
        ok = tile_ok & (slot >= 0)
        page = slot // page_size
        off = slot % page_size
        k = tl.load(k_ptr + row * stride_kr + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=ok)
        v = tl.load(v_ptr + row * stride_vr + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=ok)
        tl.store(kc_ptr + page * stride_kcp + off * stride_kco + offs_h[:, None] * stride_kch
                 + offs_d[None, :] * stride_kcd, k.to(kc_ptr.dtype.element_ty), mask=ok)
        tl.store(vc_ptr + page * stride_vcp + off * stride_vco + offs_h[:, None] * stride_vch
                 + offs_d[None, :] * stride_vcd, v.to(vc_ptr.dtype.element_ty), mask=ok)


def write_kv_triton(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_slots: Tensor) -> None:
    """Triton launcher: one persistent work item per row."""
    rows, heads, dim = k.shape
    if rows == 0:
        return
    _write_kv_kernel[dispatch.grid(rows, k.device)](
        k, v, k_cache, v_cache, kv_slots, rows, heads, dim, k_cache.shape[1],
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim),
    )


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_slots: Tensor) -> None:
    """Dispatching entry point for the cache write (inputs checked by `dspark.attention.write_kv`)."""
    if dispatch.use_triton(k, k_cache):
        write_kv_triton(k, v, k_cache, v_cache, kv_slots)
    else:
        write_kv_ref(k, v, k_cache, v_cache, kv_slots)
