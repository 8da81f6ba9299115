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


def candidate_keys(survival: Tensor, floor: int, cap: int, eps: float) -> Tensor:
    """[C, B] int32 position-major sort keys of the window: fp32 bits of s + 0.0 when valid, else -1.

    For non-negative floats the bit patterns order like the values, so the kernels compare ints.
    """
    cand = survival[:, floor - 1: cap - 1].to(torch.float32)
    bits = (cand + 0.0).view(torch.int32)
    return torch.where(cand >= eps, bits, torch.full_like(bits, -1)).t().contiguous()


if triton is not None:

    @triton.jit
    def _threshold_kernel(key_ptr, out_ptr, n, k, key_levels, BLOCK: tl.constexpr):
        """One work item: out = [t, cut]; t = key of the k-th best valid candidate (radix-16 select by
        counting), cut = 1 + index of the last tie taken at t (0 when none)."""
        d16 = tl.arange(0, 16)
        for _ in tl.range(tl.program_id(0), 1, tl.num_programs(0)):
            k_eff = k
            t = tl.zeros((), dtype=tl.int32)
            for level in tl.static_range(8):
                counts = tl.zeros((16,), dtype=tl.int32)
                for start in range(0, n, BLOCK):
                    u = tl.load(key_ptr + start + tl.arange(0, BLOCK), mask=start + tl.arange(0, BLOCK) < n,
                                other=-1)
                    ge = (u >> (28 - 4 * level))[:, None] >= (t * 16 + d16)[None, :]
                    counts += tl.sum(((u >= 0)[:, None] & ge).to(tl.int32), axis=0)
                if level == 0:
                    k_eff = tl.minimum(k, tl.max(counts, axis=0))
                t = t * 16 + tl.sum((counts >= k_eff).to(tl.int32), axis=0) - 1
            need = k_eff
            for start in range(0, n, BLOCK):
                u = tl.load(key_ptr + start + tl.arange(0, BLOCK), mask=start + tl.arange(0, BLOCK) < n, other=-1)
                need -= tl.sum((u > t).to(tl.int32), axis=0)
            cut = tl.zeros((), dtype=tl.int32)
            for level in range(key_levels):
                counts = tl.zeros((16,), dtype=tl.int32)
                for start in range(0, n, BLOCK):
                    i = start + tl.arange(0, BLOCK)
                    u = tl.load(key_ptr + i, mask=i < n, other=-1)
                    le = (i >> (4 * (key_levels - 1 - level)))[:, None] <= (cut * 16 + d16)[None, :]
                    counts += tl.sum((((u == t) & (u >= 0))[:, None] & le).to(tl.int32), axis=0)
                cut = cut * 16 + 16 - tl.sum((counts >= need).to(tl.int32), axis=0)
            tl.store(out_ptr, t)
            tl.store(out_ptr + 1, tl.where(need > 0, cut + 1, 0))

    @triton.jit
    def _lens_kernel(key_ptr, thr_ptr, lens_ptr, B, C, floor, BLOCK_C: tl.constexpr):
        """Per request (persistent loop): verify_len = F + #selected in its window column."""
        t = tl.load(thr_ptr)
        cut = tl.load(thr_ptr + 1)
        j = tl.arange(0, BLOCK_C)
        for r in tl.range(tl.program_id(0), B, tl.num_programs(0)):
            i = j * B + r
            u = tl.load(key_ptr + i, mask=j < C, other=-1)
            sel = (u >= 0) & ((u > t) | ((u == t) & (i < cut)))
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
    keys = candidate_keys(survival, floor, cap, eps)
    thr = torch.empty(2, dtype=torch.int32, device=keys.device)
    _threshold_kernel[dispatch.grid(1, keys.device)](
        keys, thr, n, k, (n.bit_length() + 3) // 4, BLOCK=min(1024, triton.next_power_of_2(n)),
    )
    _lens_kernel[dispatch.grid(b, keys.device)](keys, thr, lens, b, c, floor, BLOCK_C=triton.next_power_of_2(c))
    return lens


def verify_lens(survival: Tensor, budget: int, floor: int, cap: int, eps: float) -> Tensor:
    """Dispatch: Triton on CUDA/NPU (or when forced), the torch reference otherwise."""
    if triton is not None and dispatch.use_triton(survival):
        return verify_lens_triton(survival, budget, floor, cap, eps)
    return verify_lens_ref(survival, budget, floor, cap, eps)
