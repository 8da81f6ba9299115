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
from dspark.verify import boundary

log = logging.getLogger(__name__)

PAD_SLOT = -1  # KV write slot of padding rows: never written


def check_tiers(tiers: Sequence[int] | None, within: Sequence[int] | None = None) -> tuple[int, ...]:
    """Captured token tiers: strictly increasing positive ints (empty when None); with `within`, a non-empty
    subset of those tiers (the ones a decoder profiled)."""
    if tiers is None:
        return ()
    out = tuple(tiers)
    if within is not None and (not out or not set(out) <= set(within)):
        raise ValueError(f"tiers must be a non-empty subset of the profiled tiers {list(within)}, got {list(out)}")
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
    """Packed verify geometry for one step. Tensors live on the device of `verify_lens`; they are never written
    (a planner hands one layout to every step with the same lengths: `VerifyPlanner._host_layout`)."""

    verify_lens: Tensor      # [B] int32, rows per real request (root included)
    qo_indptr: Tensor        # [B+1] int32, [0, cumsum(verify_lens)]
    slot_lens: Tensor        # [S] int32, rows per slot: real lengths, then ghost padding rows
    slot_qo_indptr: Tensor   # [S+1] int32, [0, cumsum(slot_lens)]; ends at graph_num_tokens
    seqused: Tensor          # [S] int32, valid rows per slot (0 for ghost slots)
    row_slot: Tensor         # [graph_num_tokens] int32, slot of each packed row
    row_within: Tensor       # [graph_num_tokens] int32, index of the row inside its slot
    width: int | None        # W = gamma + 1 when known
    total_rows: int | None   # sum(verify_lens); None when not read to the host (`graph_rows`: see `real_rows`)
    graph_num_tokens: int    # rows the step runs: the tier, or total_rows when eager
    tier: int | None         # the captured tier replayed, None when eager
    eager_reason: str | None  # why no tier was used (None when a tier was used or none were given)
    # the same layout on the host when it was built there and moved (`to`): what `RaggedVerifyAttention.plan`
    # reads, so planning an accelerator step reads nothing back from the device
    host: "RaggedVerifyLayout | None" = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def num_requests(self) -> int:
        return int(self.verify_lens.numel())

    @property
    def num_slots(self) -> int:
        return int(self.slot_lens.numel())

    @property
    def num_padding_rows(self) -> int:
        return self.graph_num_tokens - self.known_total_rows

    @property
    def known_total_rows(self) -> int:
        """`total_rows`, refused with a clear error on a layout built without reading its lengths."""
        if self.total_rows is None:
            raise ValueError("this layout was built with graph_rows= (sync-free): its total rows live on the "
                             "device (`real_rows`); build it with total_rows= or from host-read lengths")
        return self.total_rows

    @property
    def real_rows(self) -> Tensor:
        """0-d int32 on the layout's device: sum(verify_lens), known without a host read."""
        return self.qo_indptr[-1]

    @property
    def row_valid(self) -> Tensor:
        """[graph_num_tokens] bool: True for real rows, False for padding rows (rows of ghost slots)."""
        return self.row_slot < self.num_requests

    @classmethod
    def from_verify_lens(
        cls,
        verify_lens: Tensor | Sequence[int],
        tiers: Sequence[int] | None = None,
        graph_slots: int | None = None,
        *,
        width: int | None = None,
        on_overflow: str = "eager",
        total_rows: int | None = None,
        graph_rows: int | None = None,
    ) -> "RaggedVerifyLayout":
        """Build the layout; pad to the smallest tier >= total rows when tiers are given.

        Args:
            verify_lens: [B] integer lengths in [1, W] (a tensor: the layout lives on its device).
            tiers: captured graph token tiers, strictly increasing (None: eager, no padding).
            graph_slots: the graph's captured slot count S >= B; padding rows need a ghost slot (S > B);
                default B + ceil(padding / W), just enough ghost slots.
            width: W = gamma + 1 when known (ghost slots hold at most W rows each).
            on_overflow: `eager` (run unpadded past the largest tier, the reason recorded) or `error`.
            total_rows: sum(verify_lens) when the caller knows it (the planner derives it from its
                decision): the lengths are then trusted, not read or re-checked.
            graph_rows: the rows the step runs, fixed before the lengths exist (sync-free planning): the
                layout is built on the device with no host read, `total_rows` None (`real_rows` holds
                it) and the default slot count assumes the most padding, `graph_rows - B`.
        Returns:
            The layout. Without `total_rows` / `graph_rows` the lengths are read to the host once
            (`dspark.verify.boundary.to_host`: the total and the range check). Inside `torch.compile` the
            row count is a shape, so one of the two must be given (ValueError otherwise); the layout then
            equals the eager one, built on the lengths' device.
        """
        vl = _as_lens(verify_lens)
        b = vl.numel()
        if width is not None:
            check_int("width", width, 1)
        if on_overflow not in ("eager", "error"):
            raise ValueError(f"on_overflow must be 'eager' or 'error', got {on_overflow!r}")
        tiers_t = check_tiers(tiers)
        if total_rows is not None and graph_rows is not None:
            raise ValueError("give total_rows or graph_rows, not both")
        if graph_rows is not None:
            check_int("graph_rows", graph_rows, b)
        elif total_rows is not None:
            check_int("total_rows", total_rows, b)
        elif dispatch.tracing():
            raise ValueError("inside torch.compile the layout's row count is a shape: pass total_rows= (the "
                             "lengths' sum, known on the host) or graph_rows= (the rows the step runs)")
        else:
            lens_np = boundary.to_host(vl)  # the host read the layout needs (a view on the CPU)
            if b and (lens_np.min() < 1 or (width is not None and lens_np.max() > width)):
                check_verify_lens(vl.cpu(), width if width is not None else int(lens_np.max()))  # names the value
            total_rows = int(lens_np.sum())
        return cls._from_lens(vl, tiers_t, graph_slots, width, total_rows=total_rows, graph_rows=graph_rows,
                                on_overflow=on_overflow)

    @classmethod
    def _from_lens(cls, verify_lens: Tensor, tiers: tuple[int, ...], graph_slots: int | None, width: int | None, *,
                     total_rows: int | None = None, graph_rows: int | None = None,
                     on_overflow: str = "eager", host: bool = False) -> "RaggedVerifyLayout":
        """`from_verify_lens` without its argument checks, for callers that validated once.

        Args:
            verify_lens: [B] int32 lengths in [1, W], trusted.
            tiers: `check_tiers`' tuple (empty: eager); graph_slots, width, on_overflow as `from_verify_lens`.
            total_rows: sum(verify_lens), or None to read it (one `boundary.to_host`; not inside
                `torch.compile`).
            graph_rows: as `from_verify_lens` (then `total_rows` is ignored).
            host: build it with numpy (`slot_maps_host`; CPU lengths, a runner's or planner's choice), else
                with torch ops on the lengths' device (`slot_maps_torch`).
        Returns:
            The layout, on the lengths' device.
        """
        b = verify_lens.numel()
        if graph_rows is not None:
            tier = graph_rows if graph_rows in tiers else None
            num_slots = _slot_count(b, graph_slots, graph_rows - b, width)
            cap = width if width is not None else max(graph_rows - b, 1)
            return cls._on_device(verify_lens, graph_rows, num_slots, cap, width, None, tier, None)
        total = int(boundary.to_host(verify_lens).sum()) if total_rows is None else total_rows
        tier, reason = None, None
        if tiers:
            tier = round_up_to_tier(total, tiers)
            if tier is None:
                reason = f"{total} verify rows exceed the largest captured tier {tiers[-1]}"
                if on_overflow == "error":
                    raise ValueError(reason + "; capture a larger tier or lower the budget")
                log.info("eager verify step: %s", reason)
        rows = tier if tier is not None else total
        leftover = rows - total
        num_slots = _slot_count(b, graph_slots, leftover, width)
        ghost_cap = width if width is not None else max(leftover, 1)
        if leftover > (num_slots - b) * ghost_cap:
            raise ValueError(
                f"{leftover} padding rows do not fit {num_slots - b} ghost slots of width {ghost_cap} "
                f"(batch {b}, graph_slots {num_slots}); capture more slots for this tier"
            )
        if not host:
            return cls._on_device(verify_lens, rows, num_slots, ghost_cap, width, total, tier, reason)
        lens_np = verify_lens.numpy()
        ghost = np.minimum(np.maximum(leftover - np.arange(num_slots - b, dtype=np.int32) * ghost_cap, 0), ghost_cap)
        slot_lens_np = np.concatenate([lens_np, ghost])
        slot_qo, row_slot, row_within = map(torch.from_numpy, _k.slot_maps_host(slot_lens_np, rows))
        return cls(verify_lens=verify_lens, qo_indptr=slot_qo[: b + 1].clone(),
                   slot_lens=torch.from_numpy(slot_lens_np), slot_qo_indptr=slot_qo,
                   seqused=torch.from_numpy(np.concatenate([lens_np, np.zeros_like(ghost)])), row_slot=row_slot,
                   row_within=row_within, width=width, total_rows=total, graph_num_tokens=rows, tier=tier,
                   eager_reason=reason)

    @classmethod
    def _on_device(cls, vl: Tensor, rows: int, num_slots: int, ghost_cap: int, width: int | None,
                   total: int | None, tier: int | None, reason: str | None) -> "RaggedVerifyLayout":
        """The layout from `slot_maps_torch` on the lengths' device: no host read."""
        slot_lens, slot_qo, seqused, row_slot, row_within = slot_maps_torch(vl, rows, num_slots, ghost_cap)
        return cls(verify_lens=vl, qo_indptr=slot_qo[: vl.numel() + 1].clone(), slot_lens=slot_lens,
                   slot_qo_indptr=slot_qo, seqused=seqused, row_slot=row_slot, row_within=row_within, width=width,
                   total_rows=total, graph_num_tokens=rows, tier=tier, eager_reason=reason)

    def to(self, device: torch.device | str) -> "RaggedVerifyLayout":
        """The same layout with its tensors on `device` (a host-built layout handed to an accelerator): one
        copy of all of them packed together (from pinned memory to CUDA, non-blocking). A layout moved off
        the host keeps the host one as `host`."""
        device = torch.device(device)
        names = [f.name for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), Tensor)]
        tensors = [getattr(self, n) for n in names]
        if all(t.device == device for t in tensors):
            return self
        to_host = device.type == "cpu"
        if all(t.dtype == torch.int32 for t in tensors):  # always, for a layout built by this class
            flat = torch.cat([t.reshape(-1) for t in tensors])
            if boundary.on_host(flat) and boundary.pinned(device):
                flat = flat.pin_memory()
            # to the device: no wait; to the host: the copy lands before the caller reads it
            parts = (flat.cpu() if to_host else boundary.to_device(flat, device)).split([t.numel() for t in tensors])
            moved = {n: p.view(t.shape) for n, p, t in zip(names, parts, tensors)}
        else:
            moved = {n: t.cpu() if to_host else boundary.to_device(t, device) for n, t in zip(names, tensors)}
        host = None if to_host else (self if boundary.on_host(self.verify_lens) else self.host)
        return dataclasses.replace(self, **moved, host=host)

    def positions(self, prefix_lens: Tensor) -> Tensor:
        """[graph_num_tokens] int64 absolute positions `prefix_len + within`; padding rows get 0."""
        if prefix_lens.shape != (self.num_requests,):
            raise ValueError(
                f"prefix_lens must be [{self.num_requests}], got {tuple(prefix_lens.shape)}"
            )
        pad = torch.zeros(self.num_slots - self.num_requests, dtype=torch.int64, device=prefix_lens.device)
        per_slot = torch.cat([prefix_lens.to(torch.int64), pad])
        device = prefix_lens.device
        # a host layout's maps reach the device without a wait
        pos = (per_slot.index_select(0, boundary.to_device(self.row_slot, device, torch.int64))
               + boundary.to_device(self.row_within, device, torch.int64))
        return torch.where(boundary.to_device(self.row_valid, device), pos, torch.zeros_like(pos))

    def kv_slots(self, positions: Tensor, block_table: Tensor, page_size: int) -> Tensor:
        """[graph_num_tokens] int64 flat KV write slot of each row, PAD_SLOT (-1) for padding rows.

        positions: `self.positions(prefix_lens)`. A row of request r at position pos writes slot
        `block_table[r, pos // page_size] * page_size + pos % page_size`. Computed on block_table's device
        without a sync; the caller checks that every real row's position fits its block-table row.
        """
        device = block_table.device
        # one zero row and column appended so padding rows (and empty tables) index something
        table = torch.nn.functional.pad(block_table.to(torch.int64), (0, 1, 0, 1))
        valid = boundary.to_device(self.row_valid, device)
        req = torch.where(valid, boundary.to_device(self.row_slot, device, torch.int64), self.num_requests)
        pos = torch.where(valid, boundary.to_device(positions, device, torch.int64), 0)
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
        return _k.pack(strided, self.row_slot, self.row_within, self.known_total_rows, fill)

    def scatter(self, packed: Tensor, width: int | None = None, fill: float = 0) -> Tensor:
        """`[rows, ...] -> [B, W, ...]` (rows >= total_rows; positions never verified = fill)."""
        check_tensor("packed", packed)
        w = check_int("width", width, 1) if width is not None else self.width
        if w is None:
            raise ValueError("scatter needs width=W (the layout was built without a width)")
        if self.num_requests and not self._fits(w):
            raise ValueError(f"width {w} is below the longest verify length {int(self.verify_lens.max())}")
        if packed.dim() < 1 or packed.shape[0] < self.known_total_rows:
            raise ValueError(
                f"packed must have at least total_rows={self.total_rows} rows, got {tuple(packed.shape)}"
            )
        return _k.scatter(packed, self.qo_indptr, w, self.known_total_rows, fill)


def slot_maps_torch(verify_lens: Tensor, rows: int, num_slots: int, ghost_cap: int
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(slot_lens [S], slot_qo_indptr [S+1], seqused [S], row_slot [rows], row_within [rows]) int32 on the
    lengths' device, for `rows` >= sum(verify_lens) rows in `num_slots` slots: the padding rows
    `rows - sum(verify_lens)` spread over the ghost slots, first ghost first, at most `ghost_cap` each
    (the caller sizes the ghosts to hold them). Shapes depend only on the int arguments, so it compiles
    with `fullgraph=True, dynamic=True` (tests/kernels/test_compile_verify_path.py); the maps are the layout kernels'."""
    b = verify_lens.numel()
    leftover = rows - verify_lens.to(torch.int64).sum()
    ghost_index = torch.arange(num_slots - b, dtype=torch.int64, device=verify_lens.device)
    ghost = (leftover - ghost_index * ghost_cap).clamp(0, ghost_cap).to(torch.int32)
    slot_lens = torch.cat([verify_lens, ghost])
    seqused = torch.cat([verify_lens, torch.zeros_like(ghost)])
    row_slot, row_within = _k.row_maps(slot_lens, rows)
    return slot_lens, _k.qo_indptr(slot_lens), seqused, row_slot, row_within


def _as_lens(verify_lens: Tensor | Sequence[int]) -> Tensor:
    vl = int_tensor("verify_lens", verify_lens, torch.int32)
    if vl.dim() != 1:
        raise ValueError(f"verify_lens must be 1-D [B], got shape {tuple(vl.shape)}")
    return vl


def _slot_count(b: int, graph_slots: int | None, leftover: int, width: int | None) -> int:
    """The captured slot count; by default just enough ghost slots (W rows each) for the padding."""
    if graph_slots is None:
        per_ghost = width if width is not None else max(leftover, 1)
        return b + -(-leftover // per_ghost)
    if isinstance(graph_slots, bool) or not isinstance(graph_slots, int) or graph_slots < b:
        raise ValueError(f"graph_slots must be an int >= the batch size {b}, got {graph_slots!r}")
    if leftover > 0 and graph_slots == b:
        raise ValueError(
            f"{leftover} padding rows need a ghost slot but graph_slots == batch size == {b}; "
            "capture the graph with at least one spare slot"
        )
    return graph_slots


def split_rows(num_requests: int, rows: int, width: int) -> list[int]:
    """verify_lens with `rows` in total spread as evenly as possible over `num_requests` (each in [1, W])."""
    if num_requests < 1 or not num_requests <= rows <= num_requests * width:
        raise ValueError(f"rows={rows} must lie in [B, B*W] = [{num_requests}, {num_requests * width}]")
    q, r = divmod(rows, num_requests)
    return [q + 1] * r + [q] * (num_requests - r)


def tier_ladder(batch_sizes: Sequence[int], width: int) -> tuple[int, ...]:
    """Token tiers for steps of these batch sizes: 1..6 and 8, then alternately x1.5 and x4/3 (12, 16, 24,
    32, 48, ...) below the largest B*W, plus every B (a plain-sized step) and B*W (the static step), so every
    fixed-k step at full batch lands on a tier top unpadded and a step pads at most half its rows. Each lies in
    [B, B*W] of some B, so a profile at these batch sizes measures it (a drained batch with fewer requests
    pads up to the smallest tier)."""
    for b in batch_sizes:
        check_int("batch size", b, 1)
    check_int("width", width, 1)
    top = max(batch_sizes) * width
    ladder, t = [1, 2, 3, 4, 5, 6], 8
    while t < top:
        ladder.append(t)
        t = t * 3 // 2 if t & (t - 1) == 0 else t * 4 // 3
    edges = {b for b in batch_sizes} | {b * width for b in batch_sizes}
    reachable = [x for x in ladder if any(b <= x <= b * width for b in batch_sizes)]
    return tuple(sorted(set(reachable) | edges))
