"""Boundary checks shared by the public modules: a bad value raises with the value in the message.

The tensor checks read the device once (`any()`), so per-step code runs them only at API boundaries.
"""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Sequence, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def _shown(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_type(name: str, value: object, cls: type[T] | tuple[type, ...], *, optional: bool = False) -> T:
    """`value` when it is an instance of `cls` (or None with optional=True); TypeError naming it otherwise."""
    if (optional and value is None) or isinstance(value, cls):
        return value  # type: ignore[return-value]
    want = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
    raise TypeError(f"{name} must be a {want}{' or None' if optional else ''}, got "
                    f"{type(value).__name__}: {_shown(value)}")


def check_tensor(name: str, value: object) -> Tensor:
    """`value` when it is a torch.Tensor; TypeError naming it and what was given otherwise."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}: {_shown(value)}")
    return value


def check_path(name: str, value: object) -> Path:
    """A str or os.PathLike as a Path; TypeError naming it otherwise."""
    return Path(check_type(name, value, (str, os.PathLike)))


def check_directory(name: str, value: object) -> Path:
    """A folder path (created when missing); ValueError when it exists and is not a folder."""
    path = check_path(name, value)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name} {str(path)!r} exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    return path


def check_sha256(name: str, value: object) -> str:
    """`value` when it is a sha256 hex digest (64 lowercase hex digits); ValueError naming it otherwise."""
    if not isinstance(value, str) or len(value) != 64 or set(value) - set("0123456789abcdef"):
        raise ValueError(f"{name} must be a sha256: 64 lowercase hex digits, got {_shown(value)}")
    return value


def check_int(name: str, value: object, minimum: int = 0) -> int:
    """`value` when it is an int (bools are not) >= minimum; ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_real(name: str, value: object, low: float = -math.inf, high: float = math.inf, *,
               low_open: bool = False, high_open: bool = False) -> float:
    """`value` as a float when it is a real number (bools are not, NaN is not) in the interval from `low` to
    `high` (closed unless `low_open` / `high_open`); ValueError naming it and the interval otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be a number in {interval}, got {_shown(value)}")
    return float(value)  # type: ignore[arg-type]


def check_output_path(name: str, value: object, *, folder: bool = False, beside: bool = False) -> Path:
    """An output path that can be written: not an existing entry of the other kind (file vs folder), and the
    folder the run will write in writable: an existing output folder itself, else (or with `beside`: the
    run writes a temporary entry next to the path and renames it) the nearest existing ancestor. Checked
    before any work, so a run cannot fail at the end."""
    path = check_path(name, value)
    if path.exists() and path.is_dir() != folder:
        raise ValueError(f"{name} {str(path)!r} exists and is not a {'folder' if folder else 'file'}")
    base = path if folder and path.is_dir() and not beside else path.parent
    while not base.exists():
        base = base.parent
    try:
        os.rmdir(tempfile.mkdtemp(dir=base, prefix=".dspark-probe."))  # what the run will do there, undone
    except OSError as e:
        raise ValueError(f"{name} {str(path)!r} cannot be written ({str(base)!r}: {e.strerror}); choose another "
                         f"path") from None
    return path


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


def first_duplicate(values: Tensor) -> tuple[int, int, int] | None:
    """(value, first index, second index) of the first repeated entry of the 1-D `values`, else None."""
    order = torch.argsort(values, stable=True)
    sorted_vals = values[order]
    same = (sorted_vals[1:] == sorted_vals[:-1]).nonzero()
    if not same.numel():
        return None
    k = int(same[0])
    i, j = sorted(int(x) for x in order[k: k + 2])
    return int(values[i]), i, j
