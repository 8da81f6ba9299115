"""One call builds the target's verify forward inputs for any execution mode (DESIGN.md section 2).

- static: every request verifies W = gamma + 1 rows and may accept all of them (caps = W).
- cap-accept: the same W rows per request, acceptance capped at accept time (caps = verify_lens);
  the target does the full B*W rows of work.
- compact: only `verify_lens[r]` rows per request, packed request-major and padded to the captured tier.

Request r's rows are its root token then its drafts, at absolute positions `prefix_lens[r] + i`.
Padding rows (ghost slots, section 4.8) get input id 0, position 0 and KV write slot -1: a model must skip
writes to slot -1 (the usual "no slot" convention of paged KV writes), so padding never touches the cache.
Model code then runs one forward over `input_ids` and hands the logits, `layout` and `caps` to accept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from dspark.config import VerifyMode
from dspark.util.validate import (
    check_int,
    check_kv_fits,
    check_nonnegative,
    check_tensor,
    check_type,
    check_verify_lens,
)
from dspark.verify.layout import PAD_SLOT, RaggedVerifyLayout, check_tiers  # noqa: F401  (PAD_SLOT: re-exported)


@dataclass(frozen=True)
class VerifyInputs:
    """Inputs of one verify forward (rows = layout.graph_num_tokens).

    input_ids [rows] int64: root then drafts per request, 0 for padding rows.
    positions [rows] int64: absolute positions `prefix_len + i`, 0 for padding rows.
    kv_slots [rows] int64 or None: paged KV write slot of each row, PAD_SLOT (-1) for padding rows;
        None when no block table was given.
    layout: the packed geometry of the forward (static / cap-accept: W rows per request).
    caps [B] int32: the verify lengths accept uses (static: W; cap-accept and compact: verify_lens).
    """

    input_ids: Tensor
    positions: Tensor
    kv_slots: Tensor | None
    layout: RaggedVerifyLayout
    caps: Tensor


@dataclass(frozen=True)
class VerifyExecution:
    """How a run's verify forwards execute, checked when built: the `mode` (a VerifyMode or its name), and the
    captured graph `tiers` (strictly increasing token counts; None or empty: eager, no padding) and slot count
    `graph_slots` (S, ghost slots included; None: B + ceil(padding / W)) the rows are padded to."""

    mode: VerifyMode | str
    tiers: Sequence[int] | None = None
    graph_slots: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", VerifyMode.parse(self.mode))
        object.__setattr__(self, "tiers", check_tiers(self.tiers))
        if self.graph_slots is not None:
            check_int("graph_slots", self.graph_slots, 1)


@dataclass(frozen=True)
class PagedKV:
    """Where a paged KV cache keeps each request's tokens, checked when built: `block_table` [B, pages] integer
    page ids per request and `page_size` tokens per page; position `pos` of request r is KV slot
    `block_table[r, pos // page_size] * page_size + pos % page_size`."""

    block_table: Tensor
    page_size: int

    def __post_init__(self) -> None:
        table = check_tensor("block_table", self.block_table)
        check_int("page_size", self.page_size, 1)
        if table.dim() != 2 or table.dtype.is_floating_point:
            raise ValueError(f"block_table must be an integer [B, pages] tensor, got {table.dtype} "
                             f"{tuple(table.shape)}")


def build_verify_inputs(
    execution: VerifyExecution,
    verify_lens: Tensor,
    root_tokens: Tensor,
    draft_tokens: Tensor,
    prefix_lens: Tensor,
    *,
    kv: PagedKV | None = None,
    layout: RaggedVerifyLayout | None = None,
) -> VerifyInputs:
    """Verify inputs for `execution.mode`: ids, positions, KV write slots, the layout and the accept caps.

    Args:
        execution: the mode, and the graph tiers / slot count the rows pad to (the smallest tier >= rows).
        verify_lens: [B] int in [1, W]; root_tokens [B]; draft_tokens [B, gamma].
        prefix_lens: [B] tokens already in the KV cache (the root sits at position prefix_len).
        kv: the cache's block table [B, pages] and page size (None: no KV write slots).
        layout: compact only: the layout the planner already built from these verify_lens with the same tiers
            and graph slots (`VerifyPlan.layout`), reused instead of built a second time; its lengths are checked.
    Returns:
        The VerifyInputs.
    """
    check_type("execution", execution, VerifyExecution)
    check_type("kv", kv, PagedKV, optional=True)
    mode, tiers, graph_slots = execution.mode, execution.tiers, execution.graph_slots
    b, gamma = _check_tokens(root_tokens, draft_tokens)
    w = gamma + 1
    device = draft_tokens.device
    vl = _check_lens("verify_lens", verify_lens, b, device)
    prefix = _check_lens("prefix_lens", prefix_lens, b, device).to(torch.int64)
    compact = mode is VerifyMode.COMPACT
    reused = _check_layout(layout, compact, b, tiers, graph_slots)
    # one device read for the checks (and the reused layout's lengths)
    rows = [vl.to(torch.int64), prefix] + ([reused.to(device, torch.int64)] if reused is not None else [])
    host = torch.stack(rows).cpu()
    host_vl, host_prefix = host[0], host[1]
    check_verify_lens(host_vl, w)
    check_nonnegative("prefix_lens", host_prefix)
    if reused is not None and not torch.equal(host[2], host_vl):
        raise ValueError(f"layout was built for verify_lens {host[2].tolist()}, not {host_vl.tolist()}")
    if layout is None:
        total = int(host_vl.sum()) if compact else b * w
        layout = RaggedVerifyLayout._from_lens(vl if compact else torch.full_like(vl, w), tiers, graph_slots, w,
                                                 total_rows=total)
    if kv is None:
        return _verify_inputs(mode, vl, root_tokens, draft_tokens, prefix, layout)
    _check_block_table(kv, b, host_prefix + (host_vl if compact else w))
    return _verify_inputs(mode, vl, root_tokens, draft_tokens, prefix, layout, kv.block_table, kv.page_size)


def _verify_inputs(mode: VerifyMode, verify_lens: Tensor, root_tokens: Tensor, draft_tokens: Tensor,
                        prefix_lens: Tensor, layout: RaggedVerifyLayout, block_table: Tensor | None = None,
                        page_size: int | None = None) -> VerifyInputs:
    """`build_verify_inputs` without its checks or host read, for a step that validated its inputs once.

    Args:
        mode: a VerifyMode member.
        verify_lens: [B] int32 in [1, W] on the tokens' device; root_tokens [B]; draft_tokens [B, gamma];
            prefix_lens [B] int64 >= 0.
        layout: the forward's layout: compact, built from `verify_lens` (`VerifyPlan.layout`); static /
            cap-accept, W rows per request.
        block_table, page_size: both or neither; every written position inside the request's pages.
    Returns:
        The VerifyInputs (no host read: every map is computed on the device).
    """
    tokens = torch.cat([root_tokens.to(torch.int64)[:, None], draft_tokens.to(torch.int64)], 1)
    positions = layout.positions(prefix_lens)
    kv_slots = None if block_table is None else layout.kv_slots(positions, block_table, page_size)
    caps = torch.full_like(verify_lens, draft_tokens.shape[1] + 1) if mode is VerifyMode.STATIC else verify_lens
    return VerifyInputs(input_ids=layout.pack(tokens, fill=0), positions=positions, kv_slots=kv_slots,
                        layout=layout, caps=caps)


def _check_tokens(root_tokens: Tensor, draft_tokens: Tensor) -> tuple[int, int]:
    for name, t, dims in (("draft_tokens", draft_tokens, 2), ("root_tokens", root_tokens, 1)):
        if not isinstance(t, Tensor) or t.dim() != dims or t.dtype.is_floating_point:
            shape = "[B, gamma]" if dims == 2 else "[B]"
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else repr(t)
            raise TypeError(f"{name} must be an integer {shape} tensor, got {got}")
    b, gamma = draft_tokens.shape
    if gamma < 1:
        raise ValueError(f"draft_tokens must hold gamma >= 1 drafts, got shape {tuple(draft_tokens.shape)}")
    if root_tokens.shape != (b,):
        raise ValueError(f"root_tokens must be [B={b}], got {tuple(root_tokens.shape)}")
    return b, gamma


def _check_layout(layout: RaggedVerifyLayout | None, compact: bool, b: int, tiers: Sequence[int] | None,
                  graph_slots: int | None) -> Tensor | None:
    """The reused layout's verify_lens (None without a layout) after the host-side checks."""
    if layout is None:
        return None
    if not isinstance(layout, RaggedVerifyLayout):
        raise TypeError(f"layout must be a RaggedVerifyLayout, got {type(layout).__name__}")
    if not compact:
        raise ValueError("a prebuilt layout is only used in compact mode (static / cap-accept verify W rows each)")
    check_layout_fits(layout, b, tiers, graph_slots)
    return layout.verify_lens


def check_layout_fits(layout: RaggedVerifyLayout, b: int, tiers: Sequence[int] | None,
                      graph_slots: int | None) -> None:
    """A prebuilt compact layout must hold `b` requests and have been built with these graph `tiers` and
    `graph_slots` (no host read)."""
    if layout.num_requests != b:
        raise ValueError(f"layout holds {layout.num_requests} requests, the batch has {b}")
    tier_ok = layout.tier in tiers if layout.tier is not None and tiers else (
        layout.tier is None and (not tiers or layout.eager_reason is not None))
    if not tier_ok or (graph_slots is not None and layout.num_slots != graph_slots):
        raise ValueError(f"layout (tier {layout.tier}, {layout.num_slots} slots) was not built with "
                         f"tiers={list(tiers or [])} and graph_slots={graph_slots}")


def _check_lens(name: str, values: Tensor, b: int, device: torch.device) -> Tensor:
    if not isinstance(values, Tensor) or values.dtype.is_floating_point or values.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {values!r}")
    if values.shape != (b,):
        raise ValueError(f"{name} must be [B={b}], got {tuple(values.shape)}")
    return values.to(device=device, dtype=torch.int32)


def _check_block_table(kv: PagedKV, b: int, ends: Tensor) -> None:
    """A table row per request, and every written position inside the request's pages."""
    if kv.block_table.shape[0] != b:
        raise ValueError(f"block_table must be an integer [B={b}, pages] tensor, got "
                         f"{kv.block_table.dtype} {tuple(kv.block_table.shape)}")
    check_kv_fits(ends, kv.block_table.shape[1], kv.page_size)
