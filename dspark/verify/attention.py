"""Verify attention with a plan/run split (like FlashInfer), safe to capture in a CUDA / NPU graph.

`RaggedVerifyAttention.plan(layout, prefix_lens, block_table)` runs on the host, validates, and copies the
step's geometry into persistent device buffers of fixed shape; `run(q, k_cache, v_cache, out=...)` only
launches (no host work, no allocation when `out` is given), so one captured `run` replays correctly for
any layout of the same tier once `plan` has refilled the buffers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from dspark.kernels import dispatch
from dspark.kernels import ragged_attention as _k
from dspark.util.validate import (
    check_int,
    check_kv_fits,
    check_nonnegative,
    check_tensor,
    check_type,
    int_tensor,
)
from dspark.verify import boundary
from dspark.verify.attention_checks import _check_dtype, _check_kv_lens, _check_tensor, _host_ints
from dspark.verify.layout import RaggedVerifyLayout


@dataclass(frozen=True)
class AttentionShape:
    """What a `RaggedVerifyAttention` is sized for, checked when built.

    Capture-time maxima: `max_rows` packed rows (the largest tier), `max_slots` request slots (real + ghost),
    `max_pages_per_slot` block-table columns; the heads (`num_q_heads` a multiple of `num_kv_heads`: GQA),
    `head_dim`, the cache's `page_size`. `sm_scale`: the softmax scale (default 1 / sqrt(head_dim));
    `max_verify_len` (optional) bounds the rows of one slot and fixes the kernel's query tile (without it the
    tile is the largest, so the compiled kernel never follows the data); `num_pages` (optional) lets `plan` check
    page ids; `num_kv_splits` cuts every slot into that many chunks (default: from the live kv lengths).
    """

    max_rows: int
    max_slots: int
    max_pages_per_slot: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sm_scale: float | None = None
    max_verify_len: int | None = None
    num_pages: int | None = None
    num_kv_splits: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_slots", "max_pages_per_slot", "num_q_heads", "num_kv_heads", "head_dim",
                     "page_size"):
            check_int(name, getattr(self, name), 0 if name in ("max_rows", "max_slots") else 1)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        for name in ("max_verify_len", "num_pages", "num_kv_splits"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        if self.max_pages_per_slot * self.page_size >= 2**31:
            raise ValueError(f"max_pages_per_slot * page_size = {self.max_pages_per_slot * self.page_size} kv "
                             f"positions per slot must stay below 2**31 (the kernel's positions are int32)")


class RaggedVerifyAttention:
    """Persistent metadata + launcher for ragged verify attention over a paged KV cache, sized by an
    `AttentionShape` (capture-time maxima, heads, page size), on `device` for K / V of `dtype`.

    Each plan builds the kernel's balanced work list (`ragged_attention.plan_work`): every slot's query tiles
    (a long prompt runs as many tiles in parallel), each tile's kv range cut into its slot's kv chunks, merged
    afterwards. `shape.num_kv_splits` cuts every slot into that many chunks; default: chunks from the live requests'
    kv lengths so that the entries fill the GPU's SMs about twice (a long prefix gets many, a ghost slot one;
    at most `MAX_KV_SPLITS`; none off CUDA). The fp32 partials live in a workspace of at most
    `SPLIT_WORKSPACE_ROWS` rows, so a step of many rows (a long prefill) splits less or not at all.
    """

    def __init__(self, shape: AttentionShape, device: torch.device | str, dtype: torch.dtype) -> None:
        check_type("shape", shape, AttentionShape)
        _check_dtype("dtype", dtype)
        self.shape, self.device, self.dtype = shape, torch.device(device), dtype
        num_q_heads, num_kv_heads, head_dim = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
        max_rows, max_slots, max_verify_len = shape.max_rows, shape.max_slots, shape.max_verify_len
        num_kv_splits = shape.num_kv_splits
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.page_size, self.max_rows, self.max_slots = shape.page_size, max_rows, max_slots
        self.max_pages_per_slot, self.max_verify_len, self.num_pages = (shape.max_pages_per_slot, max_verify_len,
                                                                        shape.num_pages)
        self.sm_scale = float(shape.sm_scale) if shape.sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self.num_kv_splits = num_kv_splits
        max_splits = (num_kv_splits if num_kv_splits is not None
                      else _k.MAX_KV_SPLITS if _k.sm_count(self.device) else 1)
        self._split_kv = _k.split_workspace(max_splits, max_rows, num_q_heads, head_dim, self.device)
        self._max_q = max_verify_len if max_verify_len is not None else _k.MAX_TILE_Q
        self._blocks = _k.kernel_blocks(num_q_heads // num_kv_heads, head_dim, self._max_q, self.device)
        self._work_target = _k.work_target(self.device, num_kv_heads) if num_kv_splits is None else 0
        self._max_work = _k.work_capacity(max_slots, max_rows, self._blocks["BLOCK_Q"], num_kv_splits,
                                          self._work_target)
        # every per-step tensor is a view of one flat device buffer, so a plan moves them in one copy
        self._flat = _metadata_buffer(self._sizes(), self.device)
        bufs = self._views(self._flat)
        self._block_table, self._qo_start, self._slot_lens, self._seqused, self._prefix = (
            bufs[n] for n in ("block_table", "qo_start", "slot_lens", "seqused", "prefix"))
        self._row_slot, self._row_within, self._kv_slots = bufs["row_slot"], bufs["row_within"], bufs["kv_slots"]
        self._work, self._work_count, self._chunks = bufs["work"], bufs["work_count"], bufs["chunks"]
        # plan writes a host staging buffer and clears only what that buffer's previous plan left behind: the
        # device buffer itself on the CPU; else two host buffers in turn (pinned for CUDA, each reused once
        # its previous copy has finished: an event), copied with one non-blocking copy per plan
        self._staging = [self._flat] if boundary.on_host(self._flat) else \
            [_metadata_buffer(self._sizes(), torch.device("cpu"), boundary.pinned(self.device)) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None] * len(self._staging)
        self._stage_filled = [(0, 0, 0, 0, 0)] * len(self._staging)  # (B, S, rows, table rows, work) each holds
        self._turn, self._table_rows = 0, 0  # next staging buffer; block-table rows the device may hold
        self._meta: _k.VerifyAttentionMeta | None = None
        self._torch_plan: _k.TorchAttentionPlan | None = None
        self._torch_meta: _k.VerifyAttentionMeta | None = None
        self.num_rows = 0

    @property
    def meta(self) -> _k.VerifyAttentionMeta:
        """The planned metadata (views of the persistent buffers); used by references and tests."""
        if self._meta is None:
            raise RuntimeError("no plan yet: call plan(layout, prefix_lens, block_table) first")
        return self._meta

    @property
    def kv_slots(self) -> Tensor:
        """[planned rows] int64 flat cache slot of each verify row (-1 for padding): feed `write_kv`."""
        return self._kv_slots[: self.num_rows]

    def plan(self, layout: RaggedVerifyLayout, prefix_lens: Tensor | Sequence[int], block_table: Tensor) -> None:
        """Host side: validate this step's geometry and copy it into the persistent device buffers.

        prefix_lens [B]: committed kv length of each request before its verify rows (host values; a device
        tensor is read). block_table [B, P] (P <= max_pages_per_slot): page ids of each request; the verify
        rows' K/V sit at positions `prefix .. prefix + verify_len - 1`. Ghost slots get kv length 0 and read
        nothing. The layout is read from its host copy (`layout.host`, or the layout itself on the CPU; a
        layout built on the device is read back). A host block table is checked page by page; one on the
        plan's device (the cache's own) is copied on the device unread, its page ids trusted. Nothing else
        leaves or enters the device but one non-blocking copy of the staged metadata.
        """
        check_type("layout", layout, RaggedVerifyLayout)
        check_tensor("block_table", block_table)
        b, s, rows = layout.num_requests, layout.num_slots, layout.graph_num_tokens
        if s > self.max_slots or rows > self.max_rows:
            raise ValueError(f"layout has {s} slots / {rows} rows; this plan holds at most "
                             f"max_slots={self.max_slots} / max_rows={self.max_rows}")
        host_layout = layout.host if layout.host is not None else layout
        if not boundary.on_host(host_layout.verify_lens):
            host_layout = host_layout.to("cpu")  # a layout built on the device: read back once
        longest = int(host_layout.slot_lens.max()) if s else 0
        if self.max_verify_len is not None and longest > self.max_verify_len:
            raise ValueError(f"a slot has {longest} rows > max_verify_len={self.max_verify_len}")
        prefix = _host_ints("prefix_lens", prefix_lens, (b,))
        check_nonnegative("prefix_lens", prefix)
        on_device = not boundary.on_host(block_table)
        table = int_tensor("block_table", block_table, torch.int32 if on_device else torch.int64)
        if table.dim() != 2 or table.shape[0] != b or table.shape[1] > self.max_pages_per_slot:
            raise ValueError(f"block_table must be [B={b}, P<={self.max_pages_per_slot}], got {tuple(table.shape)}")
        if on_device and table.device != self._flat.device:
            raise ValueError(f"block_table is on {table.device}; this plan's buffers are on {self._flat.device}")
        kv_len = prefix + host_layout.verify_lens.to(torch.int64)
        if on_device:
            check_kv_fits(kv_len, table.shape[1], self.page_size)
        else:
            _check_kv_lens(kv_len, table, self.page_size, self.num_pages)
        self._stage(host_layout, prefix, None if on_device else table)
        if on_device:
            self._block_table[:b, : table.shape[1]].copy_(table)
            self._block_table[:b, table.shape[1]:].zero_()
            self._block_table[b: self._table_rows].zero_()
            positions = layout.positions(boundary.to_device(prefix, self.device))
            self._kv_slots[:rows].copy_(layout.kv_slots(positions, table, self.page_size))
        self._table_rows = b
        self.num_rows = rows
        meta = _k.VerifyAttentionMeta(
            block_table=self._block_table, qo_start=self._qo_start, slot_lens=self._slot_lens,
            seqused=self._seqused, prefix_lens=self._prefix, row_slot=self._row_slot[:rows],
            row_within=self._row_within[:rows],
            max_q=self._max_q, work=self._work, work_count=self._work_count, chunks=self._chunks,
        )
        self._meta = meta
        # the torch path's gather indices and mask depend only on the plan: built here once, reused per run.
        # It is never captured in a graph, so it covers only this plan's b request slots, not the ghost slots
        # (padding rows only) nor all max_slots buffers: a one-request step padded to a 17-slot tier must not
        # pay for a 17-slot padded attention
        if dispatch.use_triton(self._block_table):
            self._torch_meta, self._torch_plan = None, None
        else:
            self._torch_meta = meta._replace(block_table=meta.block_table[:b], qo_start=meta.qo_start[:b],
                                             slot_lens=meta.slot_lens[:b], seqused=meta.seqused[:b],
                                             prefix_lens=meta.prefix_lens[:b], max_q=max(longest, 1))
            self._torch_plan = _k.plan_torch_attention(self._torch_meta, self.page_size, self.dtype,
                                                       int(kv_len.max()) if b else 0,
                                                       host_layout.seqused[:b].tolist(), prefix.tolist())

    def _sizes(self) -> dict[str, int]:
        """int32 words of each metadata entry, in the flat buffer's order: int64 kv_slots first (8-byte
        aligned), the block table last (a plan copies only its used rows)."""
        slots, rows = self.max_slots, self.max_rows
        return {"kv_slots": 2 * rows, "qo_start": slots, "slot_lens": slots, "seqused": slots, "prefix": slots,
                "chunks": slots, "row_slot": rows, "row_within": rows, "work_count": 1,
                "work": self._max_work * _k.WORK_FIELDS, "block_table": slots * self.max_pages_per_slot}

    def _views(self, flat: Tensor) -> dict[str, Tensor]:
        """Named views of a metadata buffer (kv_slots int64, work [max_work, WORK_FIELDS], block_table 2-D)."""
        views, at = {}, 0
        for name, n in self._sizes().items():
            views[name], at = flat[at: at + n], at + n
        views["kv_slots"] = views["kv_slots"].view(torch.int64)
        views["work"] = views["work"].view(self._max_work, _k.WORK_FIELDS)
        views["block_table"] = views["block_table"].view(self.max_slots, self.max_pages_per_slot)
        return views

    def _stage(self, layout: RaggedVerifyLayout, prefix: Tensor, table: Tensor | None) -> None:
        """Write the host `layout`'s metadata (and the host block `table`, if given) into the next staging
        buffer, clearing what that buffer's last plan left behind, and copy it to the device in one copy (the
        block table's used rows only; none of it for a device table, which `plan` copies itself)."""
        turn = self._turn
        self._turn = (turn + 1) % len(self._staging)
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # the copy of two plans ago: long done in a running step
        stage = self._views(self._staging[turn])
        (old_b, old_s, old_rows, old_table, old_work), b = self._stage_filled[turn], prefix.numel()
        s, rows = layout.num_slots, layout.graph_num_tokens
        for name, value, n, old in (
                ("prefix", prefix, b, old_b), ("qo_start", layout.slot_qo_indptr[:-1], s, old_s),
                ("slot_lens", layout.slot_lens, s, old_s), ("seqused", layout.seqused, s, old_s),
                ("row_slot", layout.row_slot, rows, old_rows), ("row_within", layout.row_within, rows, old_rows)):
            stage[name][:n] = value
            stage[name][n:old] = 0
        stage["kv_slots"][rows:old_rows] = -1
        work, chunks = self.plan_work(layout, prefix)
        stage["work"][: len(work)] = torch.from_numpy(work)
        stage["work"][len(work): old_work] = 0
        stage["work_count"][0] = len(work)
        stage["chunks"][:s] = torch.from_numpy(chunks)
        stage["chunks"][s:old_s] = 0
        table_rows = old_table
        if table is not None:
            stage["kv_slots"][:rows] = layout.kv_slots(layout.positions(prefix), table, self.page_size)
            stage["block_table"][:b, : table.shape[1]] = table
            stage["block_table"][:b, table.shape[1]:] = 0
            stage["block_table"][b:old_table] = 0
            table_rows = b
        self._stage_filled[turn] = (b, s, rows, table_rows, len(work))
        if self._staging[turn] is not self._flat:
            end = self._flat.numel() - self.max_slots * self.max_pages_per_slot  # where the block table starts
            if table is not None:
                end += max(b, self._table_rows) * self.max_pages_per_slot
            self._flat[:end].copy_(self._staging[turn][:end], non_blocking=True)
            self._copied[turn] = boundary.copy_done(self.device)

    def plan_work(self, layout: RaggedVerifyLayout, prefix: Tensor) -> tuple[np.ndarray, np.ndarray]:
        """The Triton kernel's work list and kv chunks per slot for a host layout and its prefixes [B]
        (`ragged_attention.plan_work` with this attention's tiles, workspace and GPU)."""
        ghosts = np.zeros(layout.num_slots - layout.num_requests, dtype=np.int64)
        return _k.plan_work(layout.slot_lens.numpy(), layout.seqused.numpy(),
                            np.concatenate([prefix.numpy(), ghosts]), block_q=self._blocks["BLOCK_Q"],
                            block_n=self._blocks["BLOCK_N"],
                            capacity=_k.split_capacity(self._split_kv, layout.graph_num_tokens),
                            splits=self.num_kv_splits, target=self._work_target, max_entries=self._max_work)

    def run(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor | None = None,
            lse: Tensor | None = None) -> Tensor:
        """Attention of the planned step: q [rows, Hq, D] -> out [rows, Hq, D] (and lse [rows, Hq] fp32).

        Checks only shapes/dtypes (no device sync); allocates only when `out` is None.
        """
        if self._meta is None:
            raise RuntimeError("run() before plan(): call plan(layout, prefix_lens, block_table) first")
        expect_q = (self.num_rows, self.num_q_heads, self.head_dim)
        _check_tensor("q", q, expect_q, self.dtype, self.device)
        self.check_cache(k_cache, v_cache)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        else:
            _check_tensor("out", out, expect_q, self.dtype, self.device)
        if lse is not None:
            _check_tensor("lse", lse, expect_q[:2], torch.float32, self.device)
        return self.launch(q, k_cache, v_cache, out, lse)

    def check_cache(self, k_cache: Tensor, v_cache: Tensor) -> None:
        """k_cache / v_cache [pages, page_size, Hkv, D] (one layer's; or with a leading layers dim) of this
        plan's geometry, dtype and device."""
        lead = (None,) * (k_cache.dim() - 3) if isinstance(k_cache, Tensor) and k_cache.dim() >= 4 else (None,)
        cache_shape = (*lead, self.page_size, self.num_kv_heads, self.head_dim)
        _check_tensor("k_cache", k_cache, cache_shape, self.dtype, self.device)
        _check_tensor("v_cache", v_cache, tuple(k_cache.shape), self.dtype, self.device)

    def launch(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor | None = None,
               lse: Tensor | None = None) -> Tensor:
        """`run` without its checks, for a caller that checked the caches once (`check_cache`) and hands in
        q of the planned rows (any strides: the kernel takes them): the per-layer path of a forward. A new
        `out` is contiguous whatever q's layout (the model reshapes it to [rows, Hq * D])."""
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        meta = self._meta if self._torch_meta is None else self._torch_meta
        _k.ragged_attention(q, k_cache, v_cache, meta, self.sm_scale, out, lse, self._split_kv, self._torch_plan)
        return out


def verify_attention(q: Tensor, kv_cache: tuple[Tensor, Tensor], layout: RaggedVerifyLayout,
                     prefix_lens: Tensor | Sequence[int], block_table: Tensor, *, sm_scale: float | None = None,
                     return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """One-shot plan + run sized to this call (eager use; capture a `RaggedVerifyAttention` for graphs).

    Args:
        q: [rows, Hq, D] the layout's packed query rows.
        kv_cache: (k_cache, v_cache), each [pages, page_size, Hkv, D] (FlashInfer's paged_kv_cache pair).
        layout: the step's RaggedVerifyLayout; prefix_lens [B] committed kv length of each request.
        block_table: [B, P] page ids of each request.
        sm_scale: softmax scale (default 1 / sqrt(D)); return_lse: also return lse [rows, Hq] fp32.
    Returns:
        out [rows, Hq, D], or (out, lse) with return_lse.
    """
    if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
        got = f"{len(kv_cache)} items" if isinstance(kv_cache, (tuple, list)) else type(kv_cache).__name__
        raise TypeError(f"kv_cache must be a (k_cache, v_cache) pair, got {got}")
    k_cache, v_cache = kv_cache
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table)):
        check_tensor(name, t)
    check_type("layout", layout, RaggedVerifyLayout)
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [rows, Hq, D] and k_cache [pages, page_size, Hkv, D], "
                         f"got {tuple(q.shape)} and {tuple(k_cache.shape)}")
    _check_dtype("q.dtype", q.dtype)
    shape = AttentionShape(layout.graph_num_tokens, layout.num_slots, max(int(block_table.shape[-1]), 1), q.shape[1],
                           k_cache.shape[2], q.shape[2], k_cache.shape[1], sm_scale=sm_scale, num_pages=k_cache.shape[0])
    attn = RaggedVerifyAttention(shape, q.device, q.dtype)
    attn.plan(layout, prefix_lens, block_table)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    out = attn.run(q, k_cache, v_cache, lse=lse)
    return (out, lse) if return_lse else out


def _metadata_buffer(sizes: dict[str, int], device: torch.device, pin: bool = False) -> Tensor:
    """A flat int32 buffer of a plan's metadata (`RaggedVerifyAttention._sizes`), empty: kv slots -1 (write
    nothing), everything else 0 (no work)."""
    flat = torch.zeros(sum(sizes.values()), dtype=torch.int32, device=device, pin_memory=pin)
    flat[: sizes["kv_slots"]] = -1
    return flat
