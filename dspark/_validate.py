"""Boundary checks shared by the public modules: a bad value raises with the value in the message.

The tensor checks read the device once (`any()`), so per-step code runs them only at API boundaries.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def check_int(name: str, value: object, minimum: int = 0) -> int:
    """`value` when it is an int (bools are not) >= minimum; ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def int_tensor(name: str, values: Tensor | Sequence[int], dtype: torch.dtype = torch.int64) -> Tensor:
    """An integer tensor or a sequence of ints as a `dtype` tensor (same device; lists on the CPU)."""
    if isinstance(values, Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got dtype {values.dtype}")
        return values.to(dtype)
    vals = list(values)
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must hold ints, got {v!r}")
    return torch.tensor(vals, dtype=dtype)


def check_verify_lens(values: Tensor, width: int, name: str = "verify_lens") -> None:
    """Every entry of the 1-D `values` in [1, W]; the first one outside is named."""
    bad = (values < 1) | (values > width)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{name}[{i}] = {int(values[i])} is outside [1, W={width}]")


def check_nonnegative(name: str, values: Tensor) -> None:
    """Every entry of the 1-D `values` >= 0; the first negative one is named."""
    bad = values < 0
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{name}[{i}] = {int(values[i])} is negative")


def check_kv_fits(kv_ends: Tensor, pages_per_row: int, page_size: int) -> None:
    """Every request's KV positions `0 .. kv_ends[r] - 1` fit its block-table row of `pages_per_row` pages."""
    capacity = pages_per_row * page_size
    short = kv_ends > capacity
    if bool(short.any()):
        r = int(short.nonzero()[0])
        raise ValueError(f"request {r} writes positions up to {int(kv_ends[r]) - 1} but its block table row "
                         f"holds {pages_per_row} pages of {page_size} = {capacity} positions")
