"""The plain-torch side of ragged verify attention (the layout the Triton kernel in
`dspark.kernels.ragged_attention` serves): the per-step metadata `VerifyAttentionMeta`, the fast CPU path
(`ragged_attention_torch`: slots grouped by query length, one masked SDPA per group) and the float64 reference
(`ragged_attention_ref`, one dense attention per slot)."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

SHORT_QUERY = 8  # the torch path's group of slots with at most this many query rows never splits
WORK_FIELDS = 5  # int32 fields of one work-list entry: slot, first row of its query tile, kv_lo, kv_hi, part


class VerifyAttentionMeta(NamedTuple):
    """Per-slot geometry of one verify step (int32 device tensors of fixed shape, S = slot count)."""

    block_table: Tensor  # [S, max_pages] page ids; entries past a slot's kv length are never read
    qo_start: Tensor     # [S] first packed row of each slot
    slot_lens: Tensor    # [S] rows owned by each slot (real rows, then ghost padding rows)
    seqused: Tensor      # [S] real rows of each slot (0 for ghost slots)
    prefix_lens: Tensor  # [S] committed kv length before the verify rows (kv length = prefix + seqused)
    row_slot: Tensor     # [rows] slot of each packed row (used by the torch paths)
    row_within: Tensor   # [rows] index of each packed row inside its slot
    max_q: int           # static: the torch path's bound on slot_lens (sizes its padding); the Triton path's
                         # query-tile hint (longer slots are several tiles)
    # the Triton path's work list (`plan_work`), None for the torch path
    work: Tensor | None = None        # [max_work, WORK_FIELDS] entries (slot, q0, kv_lo, kv_hi, part)
    work_count: Tensor | None = None  # [1] entries of this plan
    chunks: Tensor | None = None      # [S] kv chunks per slot (partials the merge combines)


class TorchAttentionGroup(NamedTuple):
    """Slots the torch path attends in one masked SDPA call, padded to the group's longest query (Mq rows)
    and kv span (L positions); G = the group's slot count."""

    slots: Tensor      # [G] int64 slot ids
    kv_index: Tensor   # [G * L] flat cache row of each gathered kv position (the slot's position 0 if unused)
    q_index: Tensor    # [G * Mq] packed q row of each padded query (clamped for padding)
    mask: Tensor       # [G, 1, Mq, L] additive: 0 where query j may see kv position p (padding queries see
                       # everything), -inf elsewhere; in the attention dtype so SDPA uses it as is


class TorchAttentionPlan(NamedTuple):
    """Plan-only quantities of the torch path (depend on the metadata, not on q or the cache), built once per
    plan and reused by every layer's run: its slot groups and where each packed row reads its output."""

    groups: tuple[TorchAttentionGroup, ...]
    out_index: Tensor  # [rows] padded query of each packed row in the groups' outputs laid end to end
    pad: Tensor        # [rows, 1] bool: padding row (written as zeros, lse -inf)


def group_slots(query_lens: Sequence[int], short: int = SHORT_QUERY) -> list[list[int]]:
    """Slots grouped so that padding to the group's longest query at most doubles any slot's rows: slots
    sorted by query length, longest first, each joining the open group if it has at least half that group's
    longest query, or the group's longest has at most `short` rows. query_lens [S] host ints."""
    groups: list[list[int]] = []
    longest = 0
    for s in sorted(range(len(query_lens)), key=lambda i: -int(query_lens[i])):
        n = int(query_lens[s])
        if groups and (longest <= short or 2 * n >= longest):
            groups[-1].append(s)
        else:
            groups.append([s])
            longest = n
    return groups


def plan_torch_attention(meta: VerifyAttentionMeta, page_size: int, dtype: torch.dtype,
                         kv_extent: int | None = None, query_lens: Sequence[int] | None = None,
                         prefix_lens: Sequence[int] | None = None) -> TorchAttentionPlan:
    """Gather indices and masks of `ragged_attention_torch`. kv_extent (>= every slot's kv length; default the
    whole block-table span) bounds the gathered positions, so short prefixes in a wide table read little.
    query_lens / prefix_lens [S] (host ints: `meta.seqused` / `meta.prefix_lens` as the host holds them)
    group the slots by `group_slots`, each group padded to its own longest query and kv length, so a long
    prompt beside short verify segments pads only its own group; None: one group of every slot, padded to
    `meta.max_q` and kv_extent (no host value read: what a traced step uses).
    The plan covers the meta's S slots; a packed row whose `row_slot` is >= S (a ghost slot left out of the
    meta: it only holds padding rows) is a padding row, so a tier-padded step pays for its real slots only.

    Unused positions point at the slot's own position 0 instead of being zeroed after the gather: that row is
    real data every real query sees, so a poisoned (NaN) unused page cannot leak through the masked SDPA.
    """
    num_slots, max_pages = meta.block_table.shape
    device, rows = meta.block_table.device, meta.row_slot.numel()
    span = max_pages * page_size if kv_extent is None else max(1, min(kv_extent, max_pages * page_size))
    if query_lens is None or prefix_lens is None:
        members = [list(range(num_slots))]
        bounds = [(meta.max_q, span)]
    else:
        members = group_slots(query_lens)
        bounds = [(max(1, max(int(query_lens[s]) for s in g)),
                   max(1, min(span, max(int(prefix_lens[s]) + int(query_lens[s]) for s in g)))) for g in members]
    groups, offset = [], torch.zeros(num_slots + 1, dtype=torch.int64)  # entry S: an uncovered slot
    base = 0
    for g, (mq, length) in zip(members, bounds):
        slots = torch.tensor(g, dtype=torch.int64, device=device)
        offset[g] = base + torch.arange(len(g), dtype=torch.int64) * mq
        groups.append(_plan_group(meta, slots, mq, length, page_size, dtype, rows))
        base += len(g) * mq
    rs, rw = meta.row_slot.to(torch.int64), meta.row_within.to(torch.int64)
    used = F.pad(meta.seqused.to(torch.int64), (0, 1))
    slot = rs.clamp(max=num_slots)
    pad = rw >= used.index_select(0, slot)
    out_index = torch.where(pad, 0, offset.to(device).index_select(0, slot) + rw)
    return TorchAttentionPlan(groups=tuple(groups), out_index=out_index, pad=pad[:, None])


def _plan_group(meta: VerifyAttentionMeta, slots: Tensor, max_q: int, span: int, page_size: int,
                dtype: torch.dtype, rows: int) -> TorchAttentionGroup:
    """One group's gather indices and mask: its `slots` [G] padded to max_q queries and span kv positions."""
    device = slots.device
    pos = torch.arange(span, device=device)
    prefix = meta.prefix_lens.index_select(0, slots).to(torch.int64)
    used = meta.seqused.index_select(0, slots).to(torch.int64)
    kv_len = prefix + used
    table = meta.block_table.index_select(0, slots).to(torch.int64)
    flat = table.index_select(1, pos // page_size) * page_size + (pos % page_size)[None, :]
    first = torch.where(kv_len > 0, table[:, 0] * page_size, 0)                           # ghosts: row 0
    flat = torch.where(pos[None, :] < kv_len[:, None], flat, first[:, None])
    j = torch.arange(max_q, device=device)
    limit = torch.where(j[None, :] < used[:, None], prefix[:, None] + j[None, :] + 1, span)
    mask = torch.full((slots.numel(), max_q, span), float("-inf"), dtype=dtype, device=device)
    mask.masked_fill_(pos[None, None, :] < limit[:, :, None], 0.0)                        # [G, Mq, L]
    starts = meta.qo_start.index_select(0, slots).to(torch.int64)
    q_index = (starts[:, None] + j[None, :]).clamp(0, max(rows - 1, 0))
    return TorchAttentionGroup(slots=slots, kv_index=flat.reshape(-1), q_index=q_index.reshape(-1),
                               mask=mask[:, None])


def _gather_kv(cache: Tensor, index: Tensor, num_slots: int) -> Tensor:
    """[S, Hkv, L, D] cache rows at the flat `index` [S * L]: one indexed read of the flattened cache."""
    rows = cache.reshape(-1, *cache.shape[2:]).index_select(0, index)
    return rows.reshape(num_slots, -1, *cache.shape[2:]).transpose(1, 2)


def ragged_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: VerifyAttentionMeta,
                         sm_scale: float) -> tuple[Tensor, Tensor]:
    """Float64 reference, one dense attention per slot. Returns float64 (out [rows, Hq, D], lse [rows, Hq])."""
    rows, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(rows, hq, d, dtype=torch.float64, device=q.device)
    lse = torch.full((rows, hq), float("-inf"), dtype=torch.float64, device=q.device)
    for s in range(meta.seqused.numel()):
        n, prefix, start = int(meta.seqused[s]), int(meta.prefix_lens[s]), int(meta.qo_start[s])
        if n == 0:
            continue
        pos = torch.arange(prefix + n, device=q.device)
        pages = meta.block_table[s].to(torch.int64)[pos // page_size]
        k = k_cache[pages, pos % page_size].to(torch.float64).repeat_interleave(hq // hkv, dim=1)
        v = v_cache[pages, pos % page_size].to(torch.float64).repeat_interleave(hq // hkv, dim=1)
        qs = q[start:start + n].to(torch.float64)
        scores = torch.einsum("qhd,khd->hqk", qs, k) * sm_scale
        allowed = pos[None, :] < prefix + torch.arange(n, device=q.device)[:, None] + 1
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        lse[start:start + n] = torch.logsumexp(scores, -1).T
        out[start:start + n] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    return out, lse


def ragged_attention_torch(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: VerifyAttentionMeta,
                           sm_scale: float, out: Tensor, lse: Tensor | None,
                           plan: TorchAttentionPlan | None = None) -> None:
    """Fast CPU path: one masked `scaled_dot_product_attention` call per slot group of the plan, each slot
    padded to its group's longest query.

    `plan` (from `plan_torch_attention`, built once per plan) is computed here when not given (one group).
    No host sync and no data-dependent control flow (torch.compile friendly); writes `out` (and `lse`).
    """
    rows, hq, d = q.shape
    if rows == 0:
        return
    plan = plan if plan is not None else plan_torch_attention(meta, k_cache.shape[1], q.dtype)
    if meta.seqused.numel() == 0:  # only padding rows (a capture's idle layout)
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return
    outs, lses = [], []
    for group in plan.groups:
        num_slots = group.slots.numel()
        k = _gather_kv(k_cache, group.kv_index, num_slots)                                # [G, Hkv, L, D]
        v = _gather_kv(v_cache, group.kv_index, num_slots)
        qp = q.index_select(0, group.q_index).reshape(num_slots, -1, hq, d).transpose(1, 2)  # [G, Hq, Mq, D]
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=group.mask, scale=sm_scale, enable_gqa=True)
        outs.append(o.transpose(1, 2).reshape(-1, hq, d))
        if lse is not None:
            kf = k.to(torch.float32).repeat_interleave(hq // k_cache.shape[2], dim=1)
            scores = torch.einsum("shqd,shkd->shqk", qp.to(torch.float32), kf) * sm_scale
            lses.append(torch.logsumexp(scores + group.mask, -1).transpose(1, 2).reshape(-1, hq))
    o_rows = (outs[0] if len(outs) == 1 else torch.cat(outs)).index_select(0, plan.out_index)  # [rows, Hq, D]
    out.copy_(o_rows.masked_fill_(plan.pad[:, :, None], 0.0))
    if lse is not None:
        lse_rows = (lses[0] if len(lses) == 1 else torch.cat(lses)).index_select(0, plan.out_index)
        lse.copy_(lse_rows.masked_fill_(plan.pad, float("-inf")))
