"""Accept kernels (greedy and rejection sampling) with the torch references beside them. Greedy runs one
persistent work item per (request, verify row): every verified row's argmax in parallel (a long vocabulary
row is one item, not one item per request), then the leading matches per request in a few torch ops;
rejection sampling runs one item per request.

Both return `(correct_lens int32 [B], bonus int64 [B])` and read only rows `i < verify_len[r]` of
request r. Target rows come either strided `[B, W, V]` (`row_start=None`) or packed `[rows, V]` with
`row_start[r]` = the packed row of request r's root (`qo_indptr[:-1]`); nothing is expanded to
`[B*W, V]`: the references use O(B*W + B*4096) extra memory, the kernels O(1) per request.

Sampling (DESIGN.md 4.9): draft i is accepted when `u[r, i] * q_i(d_i) < p_i(d_i)` (probability
min(1, p/q)); at the first rejection k the token is drawn from `(p_k - q_k)+` (from p_k when that is all
zero), after the last verified row from `p_{verify_len-1}`; the draw is the inverse CDF at
`u[r, W-1] * total`. The uniforms come from the caller, so every rank with the same generator agrees.
The kernel accumulates its CDF in fp32 blocks and the reference with torch.cumsum: they pick the same
token except when `u * total` falls within rounding of a CDF step (probability ~V * 1e-7 per draw);
the tests accept exactly that difference on a device (tests/kernels/test_accept_kernels.py::_draw_candidates).
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.kernels import compare as cmp
from dspark.kernels import dispatch
from dspark.kernels._triton import jit, tl, triton

REF_CHUNK = 4096  # vocabulary entries per step of the reference's final draw


def vocab_block(vocab: int) -> int:
    """Vocabulary entries one kernel step reads."""
    return max(16, min(1024, triton.next_power_of_2(max(vocab, 1))))


def row_index(row_start: Tensor | None, b: int, w: int, device: torch.device) -> Tensor:
    """[B, W] int64 row of (request, position) in the packed tensor (or in the flattened strided one)."""
    pos = torch.arange(w, device=device)
    start = (torch.arange(b, device=device) * w if row_start is None else row_start.to(torch.int64))
    return start[:, None] + pos[None, :]


def _gather_rows(target: Tensor, row_start: Tensor | None, rows: Tensor) -> Tensor:
    """[B, V] target rows at position `rows[r]` of each request (one row per request)."""
    b = rows.numel()
    if row_start is None:
        return target[torch.arange(b, device=target.device), rows]
    return target.index_select(0, row_start.to(torch.int64) + rows)


# ---------------------------------------------------------------- greedy

def greedy_ref(draft: Tensor, target_logits: Tensor, verify_lens: Tensor,
               row_start: Tensor | None) -> tuple[Tensor, Tensor]:
    """Leading matches of draft vs target argmax among verified rows, and the argmax at the first miss."""
    b, gamma = draft.shape
    w = gamma + 1
    if row_start is None:
        argmax = target_logits.argmax(-1)
    else:
        per_row = target_logits.argmax(-1)
        idx = row_index(row_start, b, w, draft.device).clamp(max=max(per_row.numel() - 1, 0))
        argmax = per_row[idx] if per_row.numel() else torch.zeros(b, w, dtype=torch.int64, device=draft.device)
    return _first_miss(draft, argmax[:, :gamma] == draft.to(torch.int64), argmax, verify_lens)


def _first_miss(draft: Tensor, match: Tensor, token_at: Tensor, verify_lens: Tensor) -> tuple[Tensor, Tensor]:
    gamma = draft.shape[1]
    verified = torch.arange(gamma, device=draft.device)[None, :] < (verify_lens[:, None] - 1)
    correct = torch.cumprod((match & verified).to(torch.int32), 1).sum(1, dtype=torch.int32)
    bonus = token_at.gather(1, correct[:, None].to(torch.int64))[:, 0]
    return correct, bonus


@jit
def _row_argmax(row_ptr, n, stride_v, BLOCK_V: tl.constexpr, FP32: tl.constexpr):
    """torch.argmax of one row: first maximum, NaN above everything (first NaN); reads n entries. FP32: the
    vocabulary loop's index compares and reductions in exact fp32 (`compare`)."""
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.zeros([], dtype=tl.int32)
    best_nan = tl.zeros([], dtype=tl.int32)
    for v0 in range(0, n, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs.to(tl.int64) * stride_v, mask=cmp.lt(offs, n, FP32),
                    other=float("-inf")).to(tl.float32)
        isn = x != x
        first_nan = cmp.first_where(isn, offs, FP32)
        m = tl.max(tl.where(isn, float("-inf"), x), 0)
        first_max = cmp.first_where(x == m, offs, FP32)
        take_nan = (first_nan < cmp.NONE) & (best_nan == 0)
        take_max = (m > best_val) & (best_nan == 0)
        best_idx = tl.where(take_nan, first_nan, tl.where(take_max, first_max, best_idx))
        best_val = tl.where(take_max, m, best_val)
        best_nan = tl.where(take_nan, 1, best_nan)
    return best_idx


@jit
def _request(item, vl_ptr, start_ptr, stride_req, stride_row, PACKED: tl.constexpr):
    """(r, verify_len, element offset of r's root row: packed row start_ptr[r], or r * stride_req)."""
    r = tl.cast(item, tl.int64)
    if PACKED:
        base = tl.load(start_ptr + r).to(tl.int64) * stride_row
    else:
        base = r * stride_req
    return r, tl.load(vl_ptr + r), base


@dispatch.kernel_kind("vector")
@jit(do_not_specialize=("cells",))
def _row_argmax_kernel(logits_ptr, vl_ptr, start_ptr, out_ptr, cells, width, vocab, stride_req, stride_row, stride_v,
                       PACKED: tl.constexpr, BLOCK_V: tl.constexpr, FP32: tl.constexpr = False):
    # One work item per (request r, row i) cell of [B, W]: out = the argmax of r's row i when i < verify_len[r],
    # else -1 (that row is not read).
    for item in tl.range(tl.program_id(0), cells, tl.num_programs(0)):
        cell = tl.cast(item, tl.int64)
        i = cell % width
        _, vl, base = _request(cell // width, vl_ptr, start_ptr, stride_req, stride_row, PACKED)
        verified = cmp.lt(i, vl, FP32)
        idx = _row_argmax(logits_ptr + base + i * stride_row, tl.where(verified, vocab, 0), stride_v, BLOCK_V, FP32)
        tl.store(out_ptr + cell, tl.where(verified, idx, -1))


def _strides(target: Tensor, row_start: Tensor | None) -> tuple[int, int, int]:
    if row_start is None:
        return target.stride(0), target.stride(1), target.stride(2)
    return 0, target.stride(0), target.stride(1)


def greedy_triton(draft: Tensor, target_logits: Tensor, verify_lens: Tensor, row_start: Tensor | None,
                  correct: Tensor, bonus: Tensor) -> tuple[Tensor, Tensor]:
    """Triton greedy accept into `correct` (int32 [B]) and `bonus` (int64 [B]): the verified rows' argmax
    [B, W] by `_row_argmax_kernel`, then `_first_miss` (no host sync)."""
    b, gamma = draft.shape
    if b:
        vocab, w = target_logits.shape[-1], gamma + 1
        argmax = torch.empty(b, w, dtype=torch.int32, device=draft.device)
        _row_argmax_kernel[dispatch.grid(b * w, draft.device, _row_argmax_kernel)](
            target_logits, verify_lens, verify_lens if row_start is None else row_start, argmax, b * w, w, vocab,
            *_strides(target_logits, row_start), PACKED=row_start is not None, BLOCK_V=vocab_block(vocab),
            FP32=dispatch.fp32_compares(draft.device, max(vocab + vocab_block(vocab), b * w)))
        token_at = argmax.to(torch.int64)
        got = _first_miss(draft, token_at[:, :gamma] == draft.to(torch.int64), token_at, verify_lens)
        correct.copy_(got[0])
        bonus.copy_(got[1])
    return correct, bonus


def greedy(draft: Tensor, target_logits: Tensor, verify_lens: Tensor,
           row_start: Tensor | None) -> tuple[Tensor, Tensor]:
    """Greedy accept: Triton on accelerators, the torch reference elsewhere (CPU, torch.compile)."""
    if not dispatch.use_kernel(target_logits):
        return greedy_ref(draft, target_logits, verify_lens, row_start)
    b = draft.shape[0]
    return greedy_triton(draft, target_logits, verify_lens, row_start,
                         torch.empty(b, dtype=torch.int32, device=draft.device),
                         torch.empty(b, dtype=torch.int64, device=draft.device))


# ---------------------------------------------------------------- rejection sampling

def sampling_ref(draft: Tensor, draft_probs: Tensor, target_probs: Tensor, verify_lens: Tensor,
                 row_start: Tensor | None, uniforms: Tensor, chunk: int = REF_CHUNK) -> tuple[Tensor, Tensor]:
    """Rejection-sampling accept; `uniforms` [B, W] float32 (columns < gamma: accept tests, W-1: the draw).

    The final draw walks the vocabulary in chunks with a carried CDF prefix, so the extra memory is
    O(B * W + B * chunk), never O(B * V).
    """
    b, gamma = draft.shape
    w = gamma + 1
    device = draft.device
    vocab = target_probs.shape[-1]
    ids = draft.to(torch.int64).clamp(0, vocab - 1)  # unverified ids may be anything; they are masked
    if row_start is None:
        p_draft = target_probs[:, :gamma].gather(2, ids[..., None])[..., 0]
    else:
        rows = row_index(row_start, b, gamma, device).clamp(max=max(target_probs.shape[0] - 1, 0))
        p_draft = target_probs[rows, ids] if target_probs.shape[0] else torch.zeros(b, gamma, device=device)
    q_draft = draft_probs.gather(2, ids[..., None])[..., 0]
    accept = uniforms[:, :gamma] * q_draft.float() < p_draft.float()
    correct, _ = _first_miss(draft, accept, torch.zeros(b, w, dtype=torch.int64, device=device), verify_lens)
    if b == 0:
        return correct, torch.zeros(0, dtype=torch.int64, device=device)
    k = correct.to(torch.int64)
    rejected = (correct < verify_lens - 1)[:, None]
    requests, k_q = torch.arange(b, device=device), k.clamp(max=gamma - 1)

    def weights(v0: int) -> tuple[Tensor, Tensor]:
        """[B, chunk] target row k and its residual (p - q)+ over vocabulary entries v0 .."""
        p = _gather_rows(target_probs[..., v0:v0 + chunk], row_start, k).float()
        q = draft_probs[..., v0:v0 + chunk][requests, k_q].float()
        return p, torch.where(rejected, (p - q).clamp_min(0), p)

    starts = range(0, vocab, chunk)
    total_p = total_res = torch.zeros(b, device=device)
    for v0 in starts:
        p, res = weights(v0)
        total_p, total_res = total_p + p.sum(-1), total_res + res.sum(-1)
    use_p = (total_res <= 0)[:, None]
    target = uniforms[:, w - 1] * torch.where(use_p[:, 0], total_p, total_res)
    prefix = torch.zeros(b, device=device)
    pick = torch.full((b,), vocab, dtype=torch.int64, device=device)
    last_pos = torch.zeros(b, dtype=torch.int64, device=device)
    for v0 in starts:
        p, res = weights(v0)
        wts = torch.where(use_p, p, res)
        cdf = prefix[:, None] + wts.cumsum(-1)
        idx = torch.arange(v0, v0 + wts.shape[1], device=device)[None, :]
        hit = (cdf > target[:, None]) & (wts > 0)
        pick = torch.minimum(pick, torch.where(hit, idx, vocab).amin(-1))
        last_pos = torch.maximum(last_pos, (idx * (wts > 0)).amax(-1))
        prefix = cdf[:, -1]
    return correct, torch.minimum(pick, last_pos)


@jit
def _last(c, BLOCK: tl.constexpr):
    """The last lane of a block (exact: the other lanes add zeros)."""
    return tl.sum(tl.where(tl.arange(0, BLOCK) == BLOCK - 1, c, 0.0), 0)


@dispatch.kernel_kind("vector")
@jit(do_not_specialize=("num_requests",))
def _sampling_kernel(draft_ptr, q_ptr, p_ptr, u_ptr, vl_ptr, start_ptr, correct_ptr, bonus_ptr,
                     num_requests, vocab, d_stride_b, d_stride_g, q_stride_b, q_stride_g, q_stride_v,
                     stride_req, stride_row, stride_v, u_stride_b, last_col,
                     PACKED: tl.constexpr, BLOCK_V: tl.constexpr, FP32: tl.constexpr = False):
    # FP32: the vocabulary loops' index compares and reductions in exact fp32 (`compare`)
    for item in tl.range(tl.program_id(0), num_requests, tl.num_programs(0)):
        r, vl, base = _request(item, vl_ptr, start_ptr, stride_req, stride_row, PACKED)
        correct = vl - 1
        for i in range(0, vl - 1):
            d = tl.load(draft_ptr + r * d_stride_b + i * d_stride_g).to(tl.int64)
            p = tl.load(p_ptr + base + i * stride_row + d * stride_v).to(tl.float32)
            q = tl.load(q_ptr + r * q_stride_b + i * q_stride_g + d * q_stride_v).to(tl.float32)
            u = tl.load(u_ptr + r * u_stride_b + i)
            correct = tl.where((u * q >= p) & (correct == vl - 1), i, correct)
        p_row = p_ptr + base + correct * stride_row
        q_row = q_ptr + r * q_stride_b + correct * q_stride_g
        q_n = tl.where(correct < vl - 1, vocab, 0)  # no residual after the last verified row
        total_res = tl.zeros([], dtype=tl.float32)
        total_p = tl.zeros([], dtype=tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            p = tl.load(p_row + offs * stride_v, mask=cmp.lt(offs, vocab, FP32), other=0.0).to(tl.float32)
            q = tl.load(q_row + offs * q_stride_v, mask=cmp.lt(offs, q_n, FP32), other=0.0).to(tl.float32)
            total_res += _last(tl.cumsum(tl.maximum(p - q, 0.0), 0), BLOCK_V)
            total_p += _last(tl.cumsum(p, 0), BLOCK_V)
        use_p = total_res <= 0.0
        target = tl.load(u_ptr + r * u_stride_b + last_col) * tl.where(use_p, total_p, total_res)
        prefix = tl.zeros([], dtype=tl.float32)
        pick = tl.full([], cmp.NONE, tl.int32)
        last_pos = tl.zeros([], dtype=tl.int32)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            p = tl.load(p_row + offs * stride_v, mask=cmp.lt(offs, vocab, FP32), other=0.0).to(tl.float32)
            q = tl.load(q_row + offs * q_stride_v, mask=cmp.lt(offs, q_n, FP32), other=0.0).to(tl.float32)
            wts = tl.where(use_p, p, tl.maximum(p - q, 0.0))
            c = prefix + tl.cumsum(wts, 0)
            pick = tl.minimum(pick, cmp.first_where((c > target) & (wts > 0.0), offs, FP32))
            last_pos = tl.maximum(last_pos, cmp.last_where(wts > 0.0, offs, FP32))
            prefix += _last(tl.cumsum(wts, 0), BLOCK_V)
        tl.store(correct_ptr + r, correct)
        tl.store(bonus_ptr + r, tl.minimum(pick, last_pos).to(tl.int64))


def sampling_triton(draft: Tensor, draft_probs: Tensor, target_probs: Tensor, verify_lens: Tensor,
                    row_start: Tensor | None, uniforms: Tensor, correct: Tensor,
                    bonus: Tensor) -> tuple[Tensor, Tensor]:
    """Triton rejection-sampling accept into `correct` (int32 [B]) and `bonus` (int64 [B])."""
    b, gamma = draft.shape
    if b:
        vocab = target_probs.shape[-1]
        _sampling_kernel[dispatch.grid(b, draft.device, _sampling_kernel)](
            draft, draft_probs, target_probs, uniforms, verify_lens,
            verify_lens if row_start is None else row_start, correct, bonus, b, vocab,
            draft.stride(0), draft.stride(1), *draft_probs.stride(), *_strides(target_probs, row_start),
            uniforms.stride(0), gamma, PACKED=row_start is not None, BLOCK_V=vocab_block(vocab),
            FP32=dispatch.fp32_compares(draft.device, vocab + vocab_block(vocab)))
    return correct, bonus


def sampling(draft: Tensor, draft_probs: Tensor, target_probs: Tensor, verify_lens: Tensor,
             row_start: Tensor | None, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """Rejection-sampling accept: Triton on accelerators, the torch reference elsewhere (CPU, torch.compile)."""
    if not dispatch.use_kernel(target_probs):
        return sampling_ref(draft, draft_probs, target_probs, verify_lens, row_start, uniforms)
    b = draft.shape[0]
    return sampling_triton(draft, draft_probs, target_probs, verify_lens, row_start, uniforms,
                           torch.empty(b, dtype=torch.int32, device=draft.device),
                           torch.empty(b, dtype=torch.int64, device=draft.device))
