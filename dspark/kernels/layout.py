"""Layout kernels: qo_indptr, per-row maps, pack and scatter, with their torch references.

Rows of the packed verify batch are request-major: request r owns rows
`[qo_indptr[r], qo_indptr[r + 1])`; rows past the real total belong to ghost slots (padding).
"""
from __future__ import annotations

import torch
from torch import Tensor


def qo_indptr_ref(lens: Tensor) -> Tensor:
    """`[0, cumsum(lens)]` as int32."""
    out = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    out[1:] = torch.cumsum(lens.to(torch.int64), 0).to(torch.int32)
    return out


def row_maps_ref(slot_lens: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """(row_slot, row_within) int32 [num_rows] for slots of the given lengths (lengths sum to num_rows)."""
    device = slot_lens.device
    slots = torch.arange(slot_lens.numel(), dtype=torch.int32, device=device)
    row_slot = torch.repeat_interleave(slots, slot_lens.to(torch.int64), output_size=num_rows)
    starts = qo_indptr_ref(slot_lens)[:-1]
    rows = torch.arange(num_rows, dtype=torch.int32, device=device)
    row_within = rows - starts.index_select(0, row_slot.to(torch.int64))
    return row_slot, row_within.to(torch.int32)


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


def scatter_ref(packed: Tensor, row_slot: Tensor, row_within: Tensor, num_requests: int, width: int,
                num_real_rows: int, fill: float) -> Tensor:
    """`[rows, ...] -> [B, W, ...]`: the inverse of pack at real rows; positions never verified = fill."""
    out = torch.full((num_requests * width, *packed.shape[1:]), fill, dtype=packed.dtype, device=packed.device)
    if num_real_rows:
        dst = row_slot[:num_real_rows].to(torch.int64) * width + row_within[:num_real_rows].to(torch.int64)
        out.index_copy_(0, dst, packed[:num_real_rows])
    return out.reshape(num_requests, width, *packed.shape[1:])


def qo_indptr(lens: Tensor) -> Tensor:
    """Dispatching entry point for `qo_indptr_ref`."""
    return qo_indptr_ref(lens)


def row_maps(slot_lens: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """Dispatching entry point for `row_maps_ref`."""
    return row_maps_ref(slot_lens, num_rows)


def pack(strided: Tensor, row_slot: Tensor, row_within: Tensor, num_real_rows: int, fill: float) -> Tensor:
    """Dispatching entry point for `pack_ref`."""
    return pack_ref(strided, row_slot, row_within, num_real_rows, fill)


def scatter(packed: Tensor, row_slot: Tensor, row_within: Tensor, num_requests: int, width: int,
            num_real_rows: int, fill: float) -> Tensor:
    """Dispatching entry point for `scatter_ref`."""
    return scatter_ref(packed, row_slot, row_within, num_requests, width, num_real_rows, fill)
