"""Ragged verify attention over a paged KV cache: the Triton kernel and its dispatch (the fast torch path and the
float64 reference live in `dspark.kernels.attention_ref`).

Packed queries `q [rows, Hq, D]`; slot s owns rows `[qo_start[s], qo_start[s] + slot_lens[s])`, of which the
first `seqused[s]` are real (ghost slots have seqused 0). Its KV lives in pages `block_table[s, :]` of
`k_cache / v_cache [num_pages, page_size, Hkv, D]`; kv position p sits at page `block_table[s, p // page_size]`,
offset `p % page_size`. Real row j of slot s sees kv positions `< prefix_lens[s] + j + 1` (its committed
prefix plus, causally, the verify rows up to itself). Query head h reads kv head `h // (Hq // Hkv)` (GQA).
Padding rows (j >= seqused) produce zeros (lse = -inf) and read nothing; nothing past a slot's kv length is read.

The metadata are plain tensors of fixed shape (see `VerifyAttentionMeta`), so one launch can be captured in a
CUDA / NPU graph and replayed after the metadata are refilled in place (`dspark.verify.attention.RaggedVerifyAttention`).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from dspark.kernels import compare as cmp
from dspark.kernels import dispatch
from dspark.kernels._triton import constexpr, jit, tl, triton
from dspark.kernels.attention_ref import (  # the torch side of this kernel, re-exported with it
    WORK_FIELDS,
    TorchAttentionPlan,
    VerifyAttentionMeta,
    group_slots,
    plan_torch_attention,
    ragged_attention_ref,
    ragged_attention_torch,
)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WORK_FIELDS = constexpr(WORK_FIELDS)
_LN2 = math.log(2.0)


def tl_dtype(dtype: torch.dtype) -> object:
    """The triton.language dtype of a torch float dtype (the kernels' dot dtype)."""
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


@jit
def _split_offset(split, row, stride_split, stride_row):
    """int64 element offset of (split, row) in the split workspace: splits x rows x Hq x D passes 2**31 from
    about 35k rows at Hq x D = 4096 and 16 splits, so neither product may be taken in int32."""
    return tl.cast(split, tl.int64) * stride_split + tl.cast(row, tl.int64) * stride_row


@dispatch.kernel_kind("dot")
@jit(do_not_specialize=("max_items",))
def _ragged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bt_ptr,
    qo_start_ptr, slot_lens_ptr, seqused_ptr, prefix_ptr, work_ptr, count_ptr,
    max_items, num_kv_heads, group, head_dim, qk_scale,
    stride_qr, stride_qh, stride_qd,
    stride_kp, stride_ko, stride_kh, stride_kd,
    stride_vp, stride_vo, stride_vh, stride_vd,
    stride_os, stride_or, stride_oh, stride_od,
    stride_ls, stride_lr, stride_lh,
    stride_bs, stride_bp,
    HAS_LSE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP32: tl.constexpr = False,
):
    # One work item = (entry w of the plan's work list, kv head): entry w = (slot, first row q0 of one query
    # tile, kv range [kv_lo, kv_hi), partial index part) (`plan_work`: count_ptr[0] entries, longest first, of
    # at most max_items // num_kv_heads), so a long prompt's tiles and a long prefix's kv chunks spread over
    # the GPU. The query tile packs (row, head-in-group) pairs into BLOCK_Q * BLOCK_G rows so every kv page
    # is read once per tile for the whole GQA group. The tile's (out, lse) over its kv range go to o/lse +
    # part * stride_os / stride_ls: the output itself (stride 0), or a split partial that
    # _merge_splits_kernel combines. qk_scale = sm_scale * log2(e). Positions and page indices are int32
    # (below the block table's span, checked < 2**31; PAGE_SIZE constexpr: a power of two is a shift),
    # element offsets int64. FP32: the row and position compares in exact fp32 (`compare`).
    offs_m = tl.arange(0, BLOCK_Q * BLOCK_G)
    m_row = offs_m // BLOCK_G
    m_head = offs_m % BLOCK_G
    head_ok = m_head < group
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    offs_n = tl.arange(0, BLOCK_N)
    n_live = tl.minimum(tl.load(count_ptr) * num_kv_heads, max_items)
    for item in tl.range(tl.program_id(0), n_live, tl.num_programs(0)):
        entry = work_ptr + tl.cast(item // num_kv_heads, tl.int64) * _WORK_FIELDS
        kvh = item % num_kv_heads
        slot = tl.load(entry)
        q0 = tl.load(entry + 1)
        kv_lo = tl.load(entry + 2)
        kv_hi = tl.load(entry + 3)
        part = tl.load(entry + 4)
        start = tl.load(qo_start_ptr + slot)
        n_rows = tl.load(slot_lens_ptr + slot)
        n_q = tl.load(seqused_ptr + slot)
        prefix = tl.load(prefix_ptr + slot)
        bt_row = bt_ptr + tl.cast(slot, tl.int64) * stride_bs
        heads = (kvh * group + m_head).to(tl.int64)
        # int64 offsets everywhere: no int32 overflow on large caches (and no interpreter overflow checks)
        q_cols = heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
        o_cols = heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        k_cols = tl.cast(kvh, tl.int64) * stride_kh + offs_d * stride_kd
        v_cols = tl.cast(kvh, tl.int64) * stride_vh + offs_d * stride_vd
        j = q0 + m_row
        real = cmp.lt(j, n_q, FP32) & head_ok
        owned = cmp.lt(j, n_rows, FP32) & head_ok
        rows = (start + j).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qr + q_cols,
                    mask=real[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
        limit = prefix + j + 1
        m_i = tl.full([BLOCK_Q * BLOCK_G], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(kv_lo, kv_hi, BLOCK_N):
            pos = n0 + offs_n
            pos_ok = cmp.lt(pos, kv_hi, FP32)
            page = tl.load(bt_row + (pos // PAGE_SIZE) * stride_bp, mask=pos_ok, other=0).to(tl.int64)
            off = (pos % PAGE_SIZE).to(tl.int64)
            kv_ok = pos_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + (page * stride_kp + off * stride_ko)[:, None] + k_cols[None, :],
                        mask=kv_ok, other=0.0).to(DOT_DTYPE)
            # V is issued before the softmax so its load overlaps the score math
            v = tl.load(v_ptr + (page * stride_vp + off * stride_vo)[:, None] + v_cols[None, :],
                        mask=kv_ok, other=0.0).to(DOT_DTYPE)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(cmp.lt(pos[None, :], limit[:, None], FP32) & real[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
            m_i = m_new
        seen = l_i > 0
        o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
        tl.store(o_ptr + _split_offset(part, 0, stride_os, 0) + rows[:, None] * stride_or + o_cols,
                 o.to(o_ptr.dtype.element_ty), mask=owned[:, None] & d_ok[None, :])
        if HAS_LSE:
            lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
            tl.store(lse_ptr + _split_offset(part, 0, stride_ls, 0) + rows * stride_lr + heads * stride_lh, lse,
                     mask=owned)


@dispatch.kernel_kind("vector")
@jit(do_not_specialize=("n_rows", "max_splits"))
def _merge_splits_kernel(
    po_ptr, pl_ptr, o_ptr, lse_ptr, row_slot_ptr, chunks_ptr, n_rows, max_splits, num_heads, head_dim,
    stride_pos, stride_por, stride_poh, stride_pod, stride_pls, stride_plr, stride_plh,
    stride_or, stride_oh, stride_od, stride_lr, stride_lh,
    HAS_LSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One work item = one packed row, all heads: out = sum_s exp(lse_s - lse) * out_s, lse = logsumexp_s lse_s,
    # over the chunks_ptr[slot of the row] (<= max_splits) kv chunks of its slot (one: a copy).
    offs_h = tl.arange(0, BLOCK_H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    h_ok = offs_h < num_heads
    tile_ok = h_ok[:, None] & (offs_d[None, :] < head_dim)
    po_cols = offs_h[:, None] * stride_poh + offs_d[None, :] * stride_pod
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        r = tl.cast(row, tl.int64)
        num_splits = tl.minimum(tl.load(chunks_ptr + tl.load(row_slot_ptr + r)), max_splits)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        for s in range(0, num_splits):
            part = tl.load(pl_ptr + _split_offset(s, r, stride_pls, stride_plr) + offs_h * stride_plh, mask=h_ok,
                           other=float("-inf"))
            m = tl.maximum(m, part)
        m = tl.where(m == float("-inf"), 0.0, m)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        weight = tl.zeros([BLOCK_H], tl.float32)
        for s in range(0, num_splits):
            part = tl.load(pl_ptr + _split_offset(s, r, stride_pls, stride_plr) + offs_h * stride_plh, mask=h_ok,
                           other=float("-inf"))
            e = tl.exp(part - m)
            acc += e[:, None] * tl.load(po_ptr + _split_offset(s, r, stride_pos, stride_por) + po_cols, mask=tile_ok,
                                        other=0.0)
            weight += e
        seen = weight > 0
        o = tl.where(seen[:, None], acc / tl.where(seen, weight, 1.0)[:, None], 0.0)
        tl.store(o_ptr + r * stride_or + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(o_ptr.dtype.element_ty), mask=tile_ok)
        if HAS_LSE:
            lse = tl.where(seen, m + tl.log(tl.where(seen, weight, 1.0)), float("-inf"))
            tl.store(lse_ptr + r * stride_lr + offs_h * stride_lh, lse, mask=h_ok)


MAX_TILE_Q = 16  # most verify rows of one query tile


def kernel_blocks(group: int, head_dim: int, max_q: int, device: torch.device) -> dict[str, int]:
    """Static tile sizes: the GQA group and up to 16 verify rows per query tile (>= 16 tile rows for tl.dot,
    at most 128, or 64 for head_dim 256, when the group allows); 8 warps once the fp32 accumulator tile reaches
    128 x 128. Untuned first guesses (no GPU was available when they were written).

    Under the interpreter (CPU tensors) wide kv blocks cost nothing and cut the interpreted loop count.
    """
    block_g = triton.next_power_of_2(group)
    max_tile_rows = 128 if head_dim <= 128 else 64
    block_q = min(triton.next_power_of_2(max(max_q, 1)), MAX_TILE_Q, max(1, max_tile_rows // block_g))
    block_q = max(block_q, 16 // min(block_g, 16))
    block_d = max(triton.next_power_of_2(head_dim), 16)
    if device.type == "cpu":
        block_n = 256
    else:
        block_n = 64 if head_dim <= 128 else 32
    num_warps = 8 if block_q * block_g * block_d >= 128 * 128 else 4
    return dict(BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps)


MAX_KV_SPLITS = 16           # most kv splits of one launch
SPLIT_WORKSPACE_ROWS = 2048  # split partial rows (splits x rows) the fp32 workspace holds: 32 MiB at Hq x D = 4096


def sm_count(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device; None elsewhere (no kv split by default)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None


def work_target(device: torch.device, num_kv_heads: int) -> int:
    """Work-list entries that, times the kv heads, make ~2 waves of the CUDA SMs; 0 off CUDA (no kv chunks)."""
    sms = sm_count(device)
    return 0 if sms is None else -(-2 * sms // num_kv_heads)


def work_capacity(max_slots: int, max_rows: int, block_q: int, splits: int | None, target: int) -> int:
    """Most work-list entries a plan fills: every slot's query tiles (at most max_slots + max_rows // BLOCK_Q in
    all), times `splits` when forced, else plus the `target` extra entries kv chunking may add."""
    tiles = max_slots + max_rows // block_q
    return tiles * splits if splits is not None else tiles + target


def plan_work(slot_lens: np.ndarray, seqused: np.ndarray, prefix: np.ndarray, *, block_q: int, block_n: int,
              capacity: int, splits: int | None, target: int, max_entries: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's balanced work list (FlashInfer's plan): (work [n, WORK_FIELDS] int32, chunks [S] int32).

    Every slot's rows are cut into query tiles of `block_q` rows (a long prompt is many tiles, run in
    parallel); a tile's causal kv range [0, kv_end) is cut into its slot's `chunks[s]` shares, rounded to
    `block_n` positions, one entry (slot, tile's first row, kv_lo, kv_hi, share index) each, longest first.
    chunks: `splits` for every slot when forced; else from one chunk length that cuts the step's whole kv
    work into about `target` entries (a long prefix gets many chunks, a short one few, ghost slots one);
    at most `capacity` (the workspace's splits for this step's rows), 1 when no chunking fits `max_entries`.
    Args: slot_lens / seqused / prefix [S] int host arrays of the layout's slots (prefix 0 for ghosts).
    """
    slot_lens, seqused, prefix = (np.asarray(x, dtype=np.int64) for x in (slot_lens, seqused, prefix))
    tiles = -(-slot_lens // block_q)
    slot_of = np.repeat(np.arange(slot_lens.size), tiles)
    q0 = (np.arange(slot_of.size) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * block_q
    n_q = seqused[slot_of]
    kv_end = np.where(q0 < n_q, prefix[slot_of] + np.minimum(q0 + block_q, n_q), 0)
    chunks = np.ones(slot_lens.size, dtype=np.int64)
    if capacity > 1 and splits is not None:
        chunks[:] = min(splits, capacity)
    elif capacity > 1 and target > 0 and kv_end.sum() > 0:
        length = -(-max(-(-int(kv_end.sum()) // target), 1) // block_n) * block_n
        longest = np.zeros(slot_lens.size, dtype=np.int64)
        np.maximum.at(longest, slot_of, kv_end)
        chunks = np.clip(-(-longest // length), 1, capacity)
    if int(chunks[slot_of].sum()) > max_entries:
        chunks[:] = 1
    per_tile = chunks[slot_of]
    share = -(-(-(-kv_end // per_tile)) // block_n) * block_n      # the kernel's former split formula
    tile = np.repeat(np.arange(slot_of.size), per_tile)
    part = np.arange(tile.size) - np.repeat(np.cumsum(per_tile) - per_tile, per_tile)
    lo = part * share[tile]
    hi = np.minimum(kv_end[tile], lo + share[tile])
    work = np.stack([slot_of[tile], q0[tile], np.minimum(lo, hi), hi, part], axis=1)
    order = np.argsort(-(hi - np.minimum(lo, hi)), kind="stable")
    return work[order].astype(np.int32), chunks.astype(np.int32)


class SplitWorkspace(NamedTuple):
    """Split-kv partials of one `RaggedVerifyAttention`: fp32 rows for `splits x rows <= out.shape[0]`."""

    out: Tensor       # [R, Hq, D] fp32 partial outputs, split s of a `rows`-row launch at s * split_rows(rows)
    lse: Tensor       # [R, Hq] fp32 partial lse
    max_splits: int   # most kv chunks of one slot


def split_workspace(max_splits: int, max_rows: int, num_heads: int, head_dim: int,
                    device: torch.device) -> SplitWorkspace | None:
    """The workspace of up to `max_splits` splits of up to `max_rows` rows, bounded by `SPLIT_WORKSPACE_ROWS`
    partial rows (a long prefill splits less, or not at all); None for 1 split."""
    rows = min(max_splits * split_rows(max(max_rows, 1)), SPLIT_WORKSPACE_ROWS)
    if max_splits <= 1:
        return None
    return SplitWorkspace(torch.empty(rows, num_heads, head_dim, dtype=torch.float32, device=device),
                          torch.empty(rows, num_heads, dtype=torch.float32, device=device), max_splits)


def split_rows(rows: int) -> int:
    """Workspace rows of one split of a `rows`-row launch: rounded up to 16, so the split strides stay
    multiples of 16 at every row count (one specialisation, aligned partials)."""
    return -(-rows // 16) * 16


def split_capacity(split_kv: SplitWorkspace | None, rows: int) -> int:
    """Most kv chunks per slot a launch of `rows` rows may use with this workspace (1: no split, no workspace)."""
    if split_kv is None or rows <= 0:
        return 1
    return max(1, min(split_kv.max_splits, split_kv.out.shape[0] // split_rows(rows)))


def ragged_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: VerifyAttentionMeta,
                            sm_scale: float, out: Tensor, lse: Tensor | None,
                            split_kv: SplitWorkspace | None = None) -> None:
    """Launch over the plan's work list (`meta.work`, `meta.work_count` entries) times the kv heads; writes
    `out` (and `lse`). No host sync. With a workspace that holds more than one split of q's rows every tile
    writes its fp32 partial and `_merge_splits_kernel` combines each row's `meta.chunks` partials into `out`;
    else the tiles write `out` directly.
    """
    rows, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    splits = split_capacity(split_kv, rows)
    n_items = meta.work.shape[0] * hkv
    if n_items == 0 or rows == 0:
        return
    if splits > 1:
        padded = split_rows(rows)
        dst = split_kv.out[: splits * padded].view(splits, padded, hq, d)[:, :rows]
        dst_lse = split_kv.lse[: splits * padded].view(splits, padded, hq)[:, :rows]
        dst_strides, lse_strides = dst.stride(), dst_lse.stride()
    else:
        dst, dst_lse = out, (lse if lse is not None else out)
        dst_strides = (0, *out.stride())
        lse_strides = (0, *lse.stride()) if lse is not None else (0, 0, 0)
    # the Triton 3.9 interpreter computes bf16 tl.dot wrongly, so interpreted bf16 runs its dots in fp32
    interpreted_bf16 = q.device.type == "cpu" and q.dtype == torch.bfloat16
    dot_dtype = tl.float32 if q.dtype == torch.float32 or interpreted_bf16 else tl_dtype(q.dtype)
    blocks = kernel_blocks(hq // hkv, d, meta.max_q, q.device)
    span = meta.block_table.shape[1] * page_size + blocks["BLOCK_N"] + blocks["BLOCK_Q"]  # positions and limits
    _ragged_attention_kernel[dispatch.grid(n_items, q.device, _ragged_attention_kernel)](
        q, k_cache, v_cache, dst, dst_lse, meta.block_table,
        meta.qo_start, meta.slot_lens, meta.seqused, meta.prefix_lens, meta.work, meta.work_count,
        n_items, hkv, hq // hkv, d, sm_scale / _LN2,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *dst_strides, *lse_strides,
        *meta.block_table.stride(),
        HAS_LSE=lse is not None or splits > 1, PAGE_SIZE=page_size, DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,  # exact fp32; backend default otherwise
        FP32=dispatch.fp32_compares(q.device, span), **blocks,
    )
    if splits > 1:
        lse_arg, out_lse_strides = (lse, lse.stride()) if lse is not None else (out, (0, 0))
        _merge_splits_kernel[dispatch.grid(rows, q.device, _merge_splits_kernel)](
            dst, dst_lse, out, lse_arg, meta.row_slot, meta.chunks, rows, splits, hq, d, *dst.stride(),
            *dst_lse.stride(), *out.stride(), *out_lse_strides, HAS_LSE=lse is not None,
            BLOCK_H=triton.next_power_of_2(hq), BLOCK_D=triton.next_power_of_2(d),
        )


def ragged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: VerifyAttentionMeta, sm_scale: float,
                     out: Tensor, lse: Tensor | None = None, split_kv: SplitWorkspace | None = None,
                     torch_plan: TorchAttentionPlan | None = None) -> None:
    """Dispatching entry point (Triton on CUDA/NPU, masked SDPA on CPU). Inputs are checked by the caller.

    torch_plan: the torch path's precomputed indices/mask (ignored by Triton; computed on the fly if None).
    """
    if dispatch.use_triton(q, k_cache, v_cache):
        ragged_attention_triton(q, k_cache, v_cache, meta, sm_scale, out, lse, split_kv)
    else:
        ragged_attention_torch(q, k_cache, v_cache, meta, sm_scale, out, lse, torch_plan)
