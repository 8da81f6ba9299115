"""`write_kv`: store a step's K / V rows into the paged cache at the slots the attention's plan validated."""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.kernels import kv_write as _kv
from dspark.util.validate import check_tensor
from dspark.verify.attention_checks import _check_dtype, _check_tensor


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, kv_slots: Tensor) -> None:
    """Store rows k, v [rows, Hkv, D] at flat cache slots `page * page_size + offset`; slot < 0 writes nothing.

    Shapes and dtypes are checked; slot values are not (no device sync): take them from
    `RaggedVerifyAttention.kv_slots`, which `plan` validated against the block table.
    """
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("kv_slots", kv_slots)):
        check_tensor(name, t)
    if k.dim() != 3 or k_cache.dim() != 4 or tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"k must be [rows, Hkv, D] matching k_cache [pages, page_size, Hkv, D], "
                         f"got {tuple(k.shape)} and {tuple(k_cache.shape)}")
    _check_dtype("k_cache.dtype", k_cache.dtype)
    _check_tensor("v", v, tuple(k.shape), k.dtype, k.device)
    _check_tensor("k_cache", k_cache, None, k_cache.dtype, k.device)
    _check_tensor("v_cache", v_cache, tuple(k_cache.shape), k_cache.dtype, k.device)
    if kv_slots.shape != (k.shape[0],) or kv_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_slots must be int32/int64 [{k.shape[0]}], got {kv_slots.dtype} {tuple(kv_slots.shape)}")
    _kv.write_kv(k, v, k_cache, v_cache, kv_slots)
