"""The engine's attention metadata: one `RaggedVerifyAttention` per model cache and batch.

Sized for the batch's largest forward, it is re-planned for every forward from that forward's
`RaggedVerifyLayout` by `dspark.models.PagedAttend`, which then writes each layer's K/V rows (padding rows
write nothing) and runs the planned attention. Prefill, draft and verify forwards all go through it.
"""
from __future__ import annotations

from typing import Any, Callable

from dspark.models.geometry import ModelGeometry
from dspark.serve.kv_cache import PagedKVCache
from dspark.verify.attention import AttentionShape, RaggedVerifyAttention


def batch_attention(cache: PagedKVCache, geometry: ModelGeometry, max_rows: int, max_slots: int,
                    backend: Callable[..., Any] | None = None) -> RaggedVerifyAttention:
    """Persistent attention metadata for one model's forwards of <= max_rows rows over <= max_slots slots
    (real + ghost), with the model's GQA head counts and softmax scale. backend: the model's
    `attention_backend` (a class taking `RaggedVerifyAttention`'s arguments, e.g. the NPU one), None: the default."""
    _, num_pages, page_size, kv_heads, head_dim = cache.k.shape
    shape = AttentionShape(max_rows, max_slots, int(cache.block_table.shape[1]), geometry.num_q_heads, kv_heads,
                           head_dim, page_size, sm_scale=geometry.sm_scale, num_pages=num_pages)
    return (backend or RaggedVerifyAttention)(shape, cache.k.device, cache.k.dtype)
