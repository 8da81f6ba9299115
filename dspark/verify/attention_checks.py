"""Input checks shared by the verify attention's plan and the KV write: dtypes, device placement, shapes and
the kv lengths against the block table, each error naming the argument and the value."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from dspark.kernels import ragged_attention as _k
from dspark.util.validate import check_kv_fits, check_tensor, int_tensor


def _check_kv_lens(kv_len: Tensor, table: Tensor, page_size: int, num_pages: int | None) -> None:
    check_kv_fits(kv_len, table.shape[1], page_size)
    used = torch.arange(table.shape[1])[None, :] * page_size < kv_len[:, None]
    bad = used & ((table < 0) | (table >= num_pages if num_pages is not None else table < 0))
    if bool(bad.any()):
        r, p = (int(x) for x in bad.nonzero()[0])
        valid = f"in [0, {num_pages})" if num_pages is not None else ">= 0"
        raise ValueError(f"block_table[{r}, {p}] = {int(table[r, p])} is not a page id {valid}")


def _host_ints(name: str, value: Tensor | Sequence[int], shape: tuple[int, ...] | None) -> Tensor:
    t = int_tensor(name, value).cpu()
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    return t


def _check_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in _k.SUPPORTED_DTYPES:
        raise TypeError(f"{name} = {dtype} is not supported; use one of "
                        f"{', '.join(str(d) for d in _k.SUPPORTED_DTYPES)}")


def _check_tensor(name: str, t: Tensor, shape: tuple[int | None, ...] | None, dtype: torch.dtype,
                  device: torch.device) -> None:
    check_tensor(name, t)
    if shape is not None and (t.dim() != len(shape) or any(e is not None and e != a for e, a in zip(shape, t.shape))):
        want = ["*" if e is None else e for e in shape]
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {dtype}")
    if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
        raise ValueError(f"{name} is on {t.device}, expected {device}")
