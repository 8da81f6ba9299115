"""Global top-k verify allocation: a Triton threshold search by counting, a numpy host path for CPU
tensors, and the torch reference that both must match.

Candidates are the window columns j in [F-1, M_max-2] of a non-increasing survival [B, gamma]; a
candidate is valid when s >= eps (NaN never is). The best k = min(budget, #valid) valid candidates in
the global order (survival desc, position asc, request asc) are selected; verify_lens = F + selected
per request.

The reference encodes that order in unique int64 keys (value bits, then the reversed position-major
index) and takes the k-th largest. The host path takes the k-th largest value t (from the budget scan's
sorted window, or one partition), every candidate >= t, and drops the ties at t past the k-th in
position-major order (rare: a tie needs equal float32 survivals). It exists because at planner sizes a
torch op costs microseconds of dispatch and the allocation is a dozen of them; numpy does the same work in
a fraction of that.

Flattening the window position-major (index i = j * B + r) makes the tie order simply
"smaller i first", so the kernel's selection is the set

    valid & (s > t  or  (s == t and i < cut))

for one threshold key t and one cut index. Keys are the int32 bit patterns of the fp32 survival
(non-negative floats order like their bits; invalid candidates get -1; on the Ascend-shaped launch the
compares of whole keys run on them as fp32, `compare.key_as_float`). The kernel finds t one hex
digit at a time (8 passes, each counting the keys at or above 16 candidate prefixes with comparisons
and int32 sums) and cut the same way over i: O(n (8 + log16 n)) work in one program, no sort, no int64
atomics, no integer sort. Indices need n = B * C < 2**31.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from dspark.kernels import compare as cmp
from dspark.kernels import dispatch
from dspark.kernels._triton import jit, tl, triton

THRESHOLD_BLOCK = 1024  # keys counted per step of the threshold search (fixed: one compiled kernel for every n)


def verify_lens_ref(survival: Tensor, budget: int | Tensor, floor: int, cap: int, eps: float) -> Tensor:
    """Torch reference on non-increasing, NaN-free survival (`monotone_survival`): the unique int64 keys
    sorted once, the k-th largest taken by index; keys below eps's key are invalid. Returns [B] int32.

    `budget` may be a host int or a 0-d integer tensor on the survival's device (a budget chosen on the
    device: no host read). No data-dependent branch, so it compiles with `fullgraph=True, dynamic=True`
    (tests/kernels/test_compile_verify_path.py)."""
    b = survival.shape[0]
    cand = survival[:, floor - 1: cap - 1]
    n = cand.numel()
    if n == 0:
        return torch.full((b,), floor, dtype=torch.int32, device=survival.device)
    bits = (cand.to(torch.float32) + 0.0).view(torch.int32).to(torch.int64)
    order = torch.arange(n - 1, -1, -1, device=cand.device).view(cand.shape[1], b).t()
    key = (bits << 31) | order
    ranked = torch.sort(key.reshape(-1), descending=True).values
    k = torch.as_tensor(budget, device=cand.device).to(torch.int64).clamp(0, n).reshape(1)
    kth = torch.where(k > 0, ranked.gather(0, (k - 1).clamp(min=0)), torch.iinfo(torch.int64).max)
    eps_key = torch.full((1,), eps, dtype=torch.float32, device=cand.device).view(torch.int32).to(torch.int64) << 31
    return (key >= torch.maximum(kth, eps_key)).sum(1, dtype=torch.int32) + floor


@functools.lru_cache(maxsize=None)
def _ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def verify_lens_host(survival: np.ndarray, budget: int, floor: int, cap: int, eps: float,
                     ranked: np.ndarray | None = None) -> Tensor:
    """numpy path of `verify_lens_ref` (identical results) on the host.

    Args:
        survival: float32 [B, gamma], non-increasing along positions and NaN-free.
        budget: int >= 0; floor, cap, eps: F, M_max and survival_eps.
        ranked: the window's values sorted ascending (float32 [B * C]) when the caller has them (the
            budget scan sorted them); else the k-th largest comes from one `np.partition`.
    Returns:
        [B] int32 CPU tensor.
    """
    cand = survival[:, floor - 1: cap - 1]
    n = cand.size
    eps32 = np.float32(eps)
    valid = np.count_nonzero(cand >= eps32) if ranked is None else n - int(ranked.searchsorted(eps32))
    k = min(budget, valid)  # the valid candidates are exactly the `valid` largest values
    if k == 0:
        return torch.full((cand.shape[0],), floor, dtype=torch.int32)
    kth = ranked[n - k] if ranked is not None else np.partition(cand, n - k, axis=None)[n - k]
    ge = cand >= kth
    lens = ge.astype(np.float32) @ _ones(ge.shape[1])  # row counts (exact) in one BLAS call
    excess = (int(lens.sum()) if ranked is None else n - int(ranked.searchsorted(kth))) - k
    if excess:  # ties at the k-th value: drop the last `excess` in position-major order (i = j * B + r)
        ties = (cand == kth).T  # [C, B]
        dropped = (np.cumsum(ties[::-1, ::-1], axis=None) <= excess).reshape(ties.shape)[::-1, ::-1] & ties
        lens = lens - np.count_nonzero(dropped, axis=0)
    return torch.from_numpy((lens + floor).astype(np.int32))


def candidate_keys(survival: Tensor, floor: int, cap: int, eps: float) -> Tensor:
    """[C, B] int32 position-major sort keys of the window: fp32 bits of s + 0.0 when valid, else -1.

    For non-negative floats the bit patterns order like the values, so the kernels compare ints.
    """
    cand = survival[:, floor - 1: cap - 1].to(torch.float32)
    bits = (cand + 0.0).view(torch.int32)
    return torch.where(cand >= eps, bits, torch.full_like(bits, -1)).t().contiguous()


@dispatch.kernel_kind("vector")
@jit(do_not_specialize=("n", "k", "key_levels"))
def _threshold_kernel(key_ptr, out_ptr, n, k, key_levels, BLOCK: tl.constexpr, FP32: tl.constexpr = False):
    """One work item: out = [t, cut]; t = key of the k-th best valid candidate (radix-16 select by
    counting), cut = 1 + index of the last tie taken at t (0 when none). FP32: every compare but the
    radix digits' (key prefixes need all 31 bits) in exact fp32 (`compare`)."""
    d16 = tl.arange(0, 16)
    for _ in tl.range(tl.program_id(0), 1, tl.num_programs(0)):
        k_eff = k
        t = tl.zeros((), dtype=tl.int32)
        for level in tl.static_range(8):
            counts = tl.zeros((16,), dtype=tl.int32)
            for start in range(0, n, BLOCK):
                i = start + tl.arange(0, BLOCK)
                u = tl.load(key_ptr + i, mask=cmp.lt(i, n, FP32), other=-1)
                ge = (u >> (28 - 4 * level))[:, None] >= (t * 16 + d16)[None, :]
                counts += tl.sum(((cmp.key_as_float(u, FP32) >= 0)[:, None] & ge).to(tl.int32), axis=0)
            if level == 0:
                k_eff = tl.minimum(k, tl.max(counts, axis=0))
            digit = tl.sum(cmp.le(k_eff, counts, FP32).to(tl.int32), axis=0) - 1
            t = tl.where(k_eff > 0, t * 16 + digit, t)
        tf = cmp.key_as_float(t, FP32)
        need = k_eff
        for start in range(0, n, BLOCK):
            i = start + tl.arange(0, BLOCK)
            f = cmp.key_as_float(tl.load(key_ptr + i, mask=cmp.lt(i, n, FP32), other=-1), FP32)
            need -= tl.sum((f > tf).to(tl.int32), axis=0)
        cut = tl.zeros((), dtype=tl.int32)
        for level in range(key_levels):
            counts = tl.zeros((16,), dtype=tl.int32)
            for start in range(0, n, BLOCK):
                i = start + tl.arange(0, BLOCK)
                f = cmp.key_as_float(tl.load(key_ptr + i, mask=cmp.lt(i, n, FP32), other=-1), FP32)
                le = cmp.le((i >> (4 * (key_levels - 1 - level)))[:, None], (cut * 16 + d16)[None, :], FP32)
                counts += tl.sum((((f == tf) & (f >= 0))[:, None] & le).to(tl.int32), axis=0)
            cut = cut * 16 + 16 - tl.sum(cmp.le(need, counts, FP32).to(tl.int32), axis=0)
        tl.store(out_ptr, t)
        tl.store(out_ptr + 1, tl.where(need > 0, cut + 1, 0))


@dispatch.kernel_kind("vector")
@jit(do_not_specialize=("B",))
def _lens_kernel(key_ptr, thr_ptr, lens_ptr, B, C, floor, BLOCK_C: tl.constexpr, FP32: tl.constexpr = False):
    """Per request (persistent loop): verify_len = F + #selected in its window column."""
    t = cmp.key_as_float(tl.load(thr_ptr), FP32)
    cut = tl.load(thr_ptr + 1)
    j = tl.arange(0, BLOCK_C)
    for r in tl.range(tl.program_id(0), B, tl.num_programs(0)):
        i = j * B + r
        u = cmp.key_as_float(tl.load(key_ptr + i, mask=cmp.lt(j, C, FP32), other=-1), FP32)
        sel = (u >= 0) & ((u > t) | ((u == t) & cmp.lt(i, cut, FP32)))
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
    fp32 = dispatch.fp32_compares(keys.device, 2 * n + 1024)   # every index, prefix and count compared
    _threshold_kernel[dispatch.grid(1, keys.device, _threshold_kernel)](
        keys, thr, n, k, (n.bit_length() + 3) // 4, BLOCK=THRESHOLD_BLOCK, FP32=fp32,
    )
    _lens_kernel[dispatch.grid(b, keys.device, _lens_kernel)](
        keys, thr, lens, b, c, floor, BLOCK_C=triton.next_power_of_2(c), FP32=fp32)
    return lens


def verify_lens(survival: Tensor, budget: int | Tensor, floor: int, cap: int, eps: float) -> Tensor:
    """Dispatch for device survival: Triton on CUDA/NPU (or when forced), the torch reference otherwise and
    inside `torch.compile` (`dispatch.use_kernel`)."""
    if dispatch.use_kernel(survival):
        return verify_lens_triton(survival, budget, floor, cap, eps)
    return verify_lens_ref(survival, budget, floor, cap, eps)
