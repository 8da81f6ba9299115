"""Compares of the kernels' inner loops in integer or exact fp32 form (the `FP32` switch).

The 910C runs int32 / int64 vector compares as scalar code (ascend.md section 1); fp32 compares are vector
ops. Where the fp32 compare is exact the Ascend-shaped launch (`dispatch.fp32_compares`) uses it:
integers (indices, positions, lengths, counts) below `FP32_EXACT` in magnitude convert to fp32 exactly,
and the int32 keys that hold fp32 bit patterns of non-negative survival compare like the floats
themselves (`key_as_float`; the invalid key -1 is a NaN, which no compare passes; a device that flushed
fp32 denormals in compares would tie survival below 1.2e-38 with 0). Launchers fall back to the integer
form when a bound could exceed `FP32_EXACT`. `dspark.ascend.launch.integer_compares()` lists what remains.
"""
from __future__ import annotations

from dspark.kernels._triton import constexpr, jit, tl

FP32_EXACT = 2**24  # every integer of smaller magnitude is exact in fp32 (24-bit significand)
NONE = constexpr(2**30)  # "no index": above any index, exact in fp32 (a power of two)


@jit
def lt(a, b, FP32: tl.constexpr):
    """a < b, in fp32 when FP32 (exact for integers below FP32_EXACT)."""
    if FP32:
        out = a * 1.0 < b * 1.0
    else:
        out = a < b
    return out


@jit
def le(a, b, FP32: tl.constexpr):
    """a <= b, in fp32 when FP32 (exact for integers below FP32_EXACT)."""
    if FP32:
        out = a * 1.0 <= b * 1.0
    else:
        out = a <= b
    return out


@jit
def key_as_float(key, FP32: tl.constexpr):
    """An int32 key holding fp32 bits (or -1 = invalid) in the form the FP32 compares use."""
    if FP32:
        out = key.to(tl.float32, bitcast=True)
    else:
        out = key
    return out


@jit
def first_where(cond, offs, FP32: tl.constexpr):
    """The smallest of `offs` (int32 indices >= 0) where `cond`, else NONE; reduced in fp32 when FP32."""
    if FP32:
        out = tl.min(tl.where(cond, offs.to(tl.float32), 1.0 * NONE), 0).to(tl.int32)
    else:
        out = tl.min(tl.where(cond, offs, NONE), 0)
    return out


@jit
def last_where(cond, offs, FP32: tl.constexpr):
    """The largest of `offs` (int32 indices >= 0) where `cond`, else 0; reduced in fp32 when FP32."""
    if FP32:
        out = tl.max(tl.where(cond, offs.to(tl.float32), 0.0), 0).to(tl.int32)
    else:
        out = tl.max(tl.where(cond, offs, 0), 0)
    return out
