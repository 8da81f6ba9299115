"""RaggedVerifyLayout: variable verify lengths packed into one query batch, padded to a graph tier.

Request r owns packed rows `[qo_indptr[r], qo_indptr[r+1])`; its first row is the root. When the step
replays a captured graph of `graph_num_tokens` rows, the rows past the real total go to ghost slots
(slots `B..S-1`) whose valid length (`seqused`) is 0: they are computed but never read and never write
the KV cache.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from dspark.kernels import dispatch
from dspark.kernels import layout as _k
from dspark.util.validate import check_int, check_tensor, check_verify_lens, int_tensor

log = logging.getLogger(__name__)

PAD_SLOT = -1  # KV write slot of padding rows: never written


def check_tiers(tiers: Sequence[int] | None) -> tuple[int, ...]:
    """Captured token tiers: strictly increasing positive ints (empty when None)."""
    if tiers is None:
        return ()
    out = tuple(tiers)
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"tiers must be positive ints, got {t!r} in {list(out)}")
    if any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"tiers must be strictly increasing, got {list(out)}")
    return out


def round_up_to_tier(total_rows: int, tiers: Sequence[int]) -> int | None:
    """Smallest tier >= total_rows, or None past the largest tier (the runtime's round-up)."""
    for t in tiers:
        if t >= total_rows:
            return t
    return None


@dataclass(frozen=True)
class RaggedVerifyLayout:
    """Packed verify geometry for one step. Tensors live on the device of `verify_lens`."""

    verify_lens: Tensor      # [B] int32, rows per real request (root included)
    qo_indptr: Tensor        # [B+1] int32, [0, cumsum(verify_lens)]
    slot_lens: Tensor        # [S] int32, rows per slot: real lengths, then ghost padding rows
    slot_qo_indptr: Tensor   # [S+1] int32, [0, cumsum(slot_lens)]; ends at graph_num_tokens
    seqused: Tensor          # [S] int32, valid rows per slot (0 for ghost slots)
    row_slot: Tensor         # [graph_num_tokens] int32, slot of each packed row
    row_within: Tensor       # [graph_num_tokens] int32, index of the row inside its slot
    width: int | None        # W = gamma + 1 when known
    total_rows: int          # sum(verify_lens)
    graph_num_tokens: int    # rows the step runs: the tier, or total_rows when eager
    tier: int | None         # the captured tier replayed, None when eager
    eager_reason: str | None  # why no tier was used (None when a tier was used or none were given)

    @property
    def num_requests(self) -> int:
        return int(self.verify_lens.numel())

    @property
    def num_slots(self) -> int:
        return int(self.slot_lens.numel())

    @property
    def num_padding_rows(self) -> int:
        return self.graph_num_tokens - self.total_rows

    @property
    def row_valid(self) -> Tensor:
        """[graph_num_tokens] bool: True for real rows, False for padding rows."""
        return torch.arange(self.graph_num_tokens, device=self.row_slot.device) < self.total_rows

    @classmethod
    def from_verify_lens(
        cls,
        verify_lens: Tensor | Sequence[int],
        tiers: Sequence[int] | None = None,
        slots: int | None = None,
        *,
        width: int | None = None,
        on_overflow: str = "eager",
    ) -> "RaggedVerifyLayout":
        """Build the layout; pad to the smallest tier >= total rows when tiers are given.

        slots: captured slot count S (>= B); padding rows need at least one ghost slot (S > B), and
        default S = B + ceil(padding / W), just enough ghost slots. on_overflow: `eager` (run unpadded, reason recorded)
        or `error` when the rows exceed the largest tier.
        """
        vl = _as_lens(verify_lens)
        b = vl.numel()
        if width is not None:
            check_int("width", width, 1)
        if on_overflow not in ("eager", "error"):
            raise ValueError(f"on_overflow must be 'eager' or 'error', got {on_overflow!r}")
        tiers_t = check_tiers(tiers)
        host = dispatch.use_host(vl)
        lens_np = vl.numpy() if host else vl.cpu().numpy()  # the host read the layout needs anyway
        if b and (lens_np.min() < 1 or (width is not None and lens_np.max() > width)):
            check_verify_lens(vl.cpu(), width if width is not None else int(lens_np.max()))  # names the value
        total = int(lens_np.sum())
        tier, reason = None, None
        if tiers_t:
            tier = round_up_to_tier(total, tiers_t)
            if tier is None:
                reason = f"{total} verify rows exceed the largest captured tier {tiers_t[-1]}"
                if on_overflow == "error":
                    raise ValueError(reason + "; capture a larger tier or lower the budget")
                log.info("eager verify step: %s", reason)
        rows = tier if tier is not None else total
        leftover = rows - total
        num_slots = _slot_count(b, slots, leftover, width)
        ghost = _ghost_lens(num_slots - b, leftover, width, b, num_slots)
        if host:
            slot_lens_np = np.concatenate([lens_np, ghost])
            slot_qo, row_slot, row_within = map(torch.from_numpy, _k.slot_maps_host(slot_lens_np, rows))
            slot_lens = torch.from_numpy(slot_lens_np)
            seqused = torch.from_numpy(np.concatenate([lens_np, np.zeros_like(ghost)]))
        else:
            ghost_t = torch.from_numpy(ghost).to(vl.device)
            slot_lens = torch.cat([vl, ghost_t])
            seqused = torch.cat([vl, torch.zeros_like(ghost_t)])
            row_slot, row_within = _k.row_maps(slot_lens, rows)
            slot_qo = _k.qo_indptr(slot_lens)
        return cls(
            verify_lens=vl,
            qo_indptr=slot_qo[: b + 1].clone(),
            slot_lens=slot_lens,
            slot_qo_indptr=slot_qo,
            seqused=seqused,
            row_slot=row_slot,
            row_within=row_within,
            width=width,
            total_rows=total,
            graph_num_tokens=rows,
            tier=tier,
            eager_reason=reason,
        )

    def to(self, device: torch.device | str) -> "RaggedVerifyLayout":
        """The same layout with its tensors on `device` (a host-built layout handed to an accelerator)."""
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=True)
                 for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), Tensor)}
        return dataclasses.replace(self, **moved)

    def positions(self, prefix_lens: Tensor) -> Tensor:
        """[graph_num_tokens] int64 absolute positions `prefix_len + within`; padding rows get 0."""
        if prefix_lens.shape != (self.num_requests,):
            raise ValueError(
                f"prefix_lens must be [{self.num_requests}], got {tuple(prefix_lens.shape)}"
            )
        pad = torch.zeros(self.num_slots - self.num_requests, dtype=torch.int64, device=prefix_lens.device)
        per_slot = torch.cat([prefix_lens.to(torch.int64), pad])
        device = prefix_lens.device
        pos = (per_slot.index_select(0, self.row_slot.to(device=device, dtype=torch.int64))
               + self.row_within.to(device=device, dtype=torch.int64))
        return torch.where(self.row_valid.to(device), pos, torch.zeros_like(pos))

    def kv_slots(self, positions: Tensor, block_table: Tensor, page_size: int) -> Tensor:
        """[graph_num_tokens] int64 flat KV write slot of each row, PAD_SLOT (-1) for padding rows.

        positions: `self.positions(prefix_lens)`. A row of request r at position pos writes slot
        `block_table[r, pos // page_size] * page_size + pos % page_size`. Computed on block_table's device
        without a sync; the caller checks that every real row's position fits its block-table row.
        """
        device = block_table.device
        # one zero row and column appended so padding rows (and empty tables) index something
        table = torch.nn.functional.pad(block_table.to(torch.int64), (0, 1, 0, 1))
        valid = self.row_valid.to(device)
        req = torch.where(valid, self.row_slot.to(device=device, dtype=torch.int64), self.num_requests)
        pos = torch.where(valid, positions.to(device=device, dtype=torch.int64), 0)
        slots = table[req, pos // page_size] * page_size + pos % page_size
        return torch.where(valid, slots, torch.full_like(slots, PAD_SLOT))

    def _fits(self, width: int) -> bool:
        """width >= every verify length; no device read when the layout's W (an upper bound) decides it."""
        return (self.width is not None and width >= self.width) or width >= int(self.verify_lens.max())

    def pack(self, strided: Tensor, fill: float = 0) -> Tensor:
        """`[B, W, ...] -> [graph_num_tokens, ...]` (padding rows = fill)."""
        if check_tensor("strided", strided).dim() < 2 or strided.shape[0] != self.num_requests:
            raise ValueError(
                f"strided must be [B={self.num_requests}, W, ...], got {tuple(strided.shape)}"
            )
        if self.num_requests and not self._fits(strided.shape[1]):
            raise ValueError(
                f"strided width {strided.shape[1]} is below the longest verify length "
                f"{int(self.verify_lens.max())}"
            )
        return _k.pack(strided, self.row_slot, self.row_within, self.total_rows, fill)

    def scatter(self, packed: Tensor, width: int | None = None, fill: float = 0) -> Tensor:
        """`[rows, ...] -> [B, W, ...]` (rows >= total_rows; positions never verified = fill)."""
        check_tensor("packed", packed)
        w = check_int("width", width, 1) if width is not None else self.width
        if w is None:
            raise ValueError("scatter needs width=W (the layout was built without a width)")
        if self.num_requests and not self._fits(w):
            raise ValueError(f"width {w} is below the longest verify length {int(self.verify_lens.max())}")
        if packed.dim() < 1 or packed.shape[0] < self.total_rows:
            raise ValueError(
                f"packed must have at least total_rows={self.total_rows} rows, got {tuple(packed.shape)}"
            )
        return _k.scatter(packed, self.qo_indptr, w, self.total_rows, fill)


def _as_lens(verify_lens: Tensor | Sequence[int]) -> Tensor:
    vl = int_tensor("verify_lens", verify_lens, torch.int32)
    if vl.dim() != 1:
        raise ValueError(f"verify_lens must be 1-D [B], got shape {tuple(vl.shape)}")
    return vl


def _slot_count(b: int, slots: int | None, leftover: int, width: int | None) -> int:
    """The captured slot count; by default just enough ghost slots (W rows each) for the padding."""
    if slots is None:
        per_ghost = width if width is not None else max(leftover, 1)
        return b + -(-leftover // per_ghost)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < b:
        raise ValueError(f"slots must be an int >= the batch size {b}, got {slots!r}")
    if leftover > 0 and slots == b:
        raise ValueError(
            f"{leftover} padding rows need a ghost slot but slots == batch size == {b}; "
            "capture the graph with at least one spare slot"
        )
    return slots


def _ghost_lens(num_ghosts: int, leftover: int, width: int | None, b: int, num_slots: int) -> np.ndarray:
    """Padding rows spread over ghost slots, first ghost first, at most W rows each (host int32)."""
    cap = width if width is not None else max(leftover, 1)
    if leftover > num_ghosts * cap:
        raise ValueError(
            f"{leftover} padding rows do not fit {num_ghosts} ghost slots of width {cap} "
            f"(batch {b}, slots {num_slots}); capture more slots for this tier"
        )
    return np.array([min(cap, max(0, leftover - g * cap)) for g in range(num_ghosts)], dtype=np.int32)
