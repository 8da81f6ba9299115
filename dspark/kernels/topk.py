"""Global top-k verify allocation: a Triton threshold search by counting, and its torch reference.

Candidates are the window columns j in [F-1, M_max-2] of a non-increasing survival [B, gamma]; a
candidate is valid when s >= eps (NaN never is). The best k = min(budget, #valid) valid candidates in
the global order (survival desc, position asc, request asc) are selected; verify_lens = F + selected
per request. Flattening the window position-major (index i = j * B + r) makes the tie order simply
"smaller i first", so the selection is the set

    valid & (s > t  or  (s == t and i < cut))

for one threshold value t and one cut index. The kernel finds t by bisection over fp32 bit patterns
(non-negative floats order like their bits) and cut by bisection over i, each step counting candidates
with comparisons and int32 sums: O(n (32 + log2 n)) work, no sort, no int64 atomics.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.kernels import dispatch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is Linux-only
    triton = None

_INF_BITS = 0x7F800000  # +inf as fp32 bits: the top of the threshold search range


def verify_lens_ref(survival: Tensor, budget: int, floor: int, cap: int, eps: float) -> Tensor:
    """Torch reference: threshold by topk, ties taken in position-major order. Returns [B] int32."""
    b = survival.shape[0]
    cand = survival[:, floor - 1: cap - 1]
    n = cand.numel()
    out = torch.full((b,), floor, dtype=torch.int32, device=survival.device)
    k = min(budget, n)
    if k == 0:
        return out
    valid = cand >= eps
    v = torch.where(valid, cand, torch.full_like(cand, -1.0))
    t = torch.topk(v.reshape(-1), k, sorted=False).values.min()
    above = valid & (v > t)
    ties = valid & (v == t)
    need = k - above.sum()
    tie_rank = ties.t().reshape(-1).cumsum(0).reshape(cand.shape[1], b).t()
    selected = above | (ties & (tie_rank <= need))
    return out + selected.sum(1, dtype=torch.int32)


if triton is not None:

    @triton.jit
    def _count(s_ptr, stride_b, stride_g, col0, B, n, eps, t, cut, STRICT: tl.constexpr,
               TIES: tl.constexpr, BLOCK: tl.constexpr):
        """Valid candidates with s >= t (s > t when STRICT), or with s == t and index < cut (TIES)."""
        total = tl.zeros((), dtype=tl.int32)
        for start in range(0, n, BLOCK):
            i = start + tl.arange(0, BLOCK)
            inside = i < n
            j = i // B
            r = i - j * B
            v = tl.load(s_ptr + r * stride_b + (col0 + j) * stride_g, mask=inside, other=-1.0)
            hit = inside & (v >= eps)
            if TIES:
                hit = hit & (v == t) & (i < cut)
            elif STRICT:
                hit = hit & (v > t)
            else:
                hit = hit & (v >= t)
            total += tl.sum(hit.to(tl.int32), axis=0)
        return total

    @triton.jit
    def _threshold_kernel(s_ptr, out_ptr, stride_b, stride_g, col0, B, n, k, eps, key_iters,
                          BLOCK: tl.constexpr):
        """One work item: out = [bits of t, cut] for the k best valid candidates."""
        for _ in tl.range(tl.program_id(0), 1, tl.num_programs(0)):
            num_valid = _count(s_ptr, stride_b, stride_g, col0, B, n, eps, 0.0, 0, False, False, BLOCK)
            k_eff = tl.minimum(k, num_valid)
            lo = tl.zeros((), dtype=tl.int32)
            hi = tl.full((), _INF_BITS, dtype=tl.int32)
            for _it in range(31):
                mid = lo + (hi - lo + 1) // 2
                t = mid.to(tl.float32, bitcast=True)
                c = _count(s_ptr, stride_b, stride_g, col0, B, n, eps, t, 0, False, False, BLOCK)
                lo = tl.where(c >= k_eff, mid, lo)
                hi = tl.where(c >= k_eff, hi, mid - 1)
            t = lo.to(tl.float32, bitcast=True)
            need = k_eff - _count(s_ptr, stride_b, stride_g, col0, B, n, eps, t, 0, True, False, BLOCK)
            c_lo = tl.zeros((), dtype=tl.int32)
            c_hi = n + tl.zeros((), dtype=tl.int32)
            for _it in range(key_iters):
                mid = (c_lo + c_hi) // 2
                c = _count(s_ptr, stride_b, stride_g, col0, B, n, eps, t, mid, False, True, BLOCK)
                c_hi = tl.where(c >= need, mid, c_hi)
                c_lo = tl.where(c >= need, c_lo, mid + 1)
            tl.store(out_ptr, lo)
            tl.store(out_ptr + 1, c_lo)

    @triton.jit
    def _lens_kernel(s_ptr, thr_ptr, lens_ptr, stride_b, stride_g, col0, B, C, floor, eps,
                     BLOCK_C: tl.constexpr):
        """Per request (persistent loop): verify_len = F + #selected in its window."""
        t = tl.load(thr_ptr).to(tl.float32, bitcast=True)
        cut = tl.load(thr_ptr + 1)
        j = tl.arange(0, BLOCK_C)
        for r in tl.range(tl.program_id(0), B, tl.num_programs(0)):
            inside = j < C
            v = tl.load(s_ptr + r * stride_b + (col0 + j) * stride_g, mask=inside, other=-1.0)
            sel = inside & (v >= eps) & ((v > t) | ((v == t) & (j * B + r < cut)))
            tl.store(lens_ptr + r, floor + tl.sum(sel.to(tl.int32), axis=0))


def verify_lens_triton(survival: Tensor, budget: int, floor: int, cap: int, eps: float,
                       out: Tensor | None = None) -> Tensor:
    """Triton path of `verify_lens_ref` (identical results), written into `out` ([B] int32) if given."""
    b = survival.shape[0]
    c = cap - floor
    n = b * c
    lens = torch.empty(b, dtype=torch.int32, device=survival.device) if out is None else out
    k = min(budget, n)
    if k == 0:
        return lens.fill_(floor)
    s = survival.to(torch.float32)
    thr = torch.empty(2, dtype=torch.int32, device=s.device)
    key_iters = max(1, n.bit_length())
    _threshold_kernel[dispatch.grid(1, s.device)](
        s, thr, s.stride(0), s.stride(1), floor - 1, b, n, k, float(eps), key_iters,
        BLOCK=min(1024, triton.next_power_of_2(n)),
    )
    _lens_kernel[dispatch.grid(b, s.device)](
        s, thr, lens, s.stride(0), s.stride(1), floor - 1, b, c, floor, float(eps),
        BLOCK_C=triton.next_power_of_2(c),
    )
    return lens


def verify_lens(survival: Tensor, budget: int, floor: int, cap: int, eps: float) -> Tensor:
    """Dispatch: Triton on CUDA/NPU (or when forced), the torch reference otherwise."""
    if triton is not None and dispatch.use_triton(survival):
        return verify_lens_triton(survival, budget, floor, cap, eps)
    return verify_lens_ref(survival, budget, floor, cap, eps)
