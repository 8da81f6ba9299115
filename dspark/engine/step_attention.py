"""Per-forward attention for the engine: dspark's ragged verify attention over the paged KV cache.

One `RaggedVerifyAttention` per cache and batch (sized for the batch's largest forward) is re-planned
for every forward from that forward's `RaggedVerifyLayout`; each layer then writes its K/V rows
(padding rows write nothing) and runs the planned attention. Prefill, draft and verify forwards all
go through it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.attention import RaggedVerifyAttention, write_kv
from dspark.engine.kv_cache import PagedKVCache
from dspark.layout import RaggedVerifyLayout
from dspark.models.geometry import ModelGeometry


def batch_attention(cache: PagedKVCache, geometry: ModelGeometry, max_rows: int, max_slots: int
                    ) -> RaggedVerifyAttention:
    """Persistent attention metadata for one model's forwards of <= max_rows rows over <= max_slots slots
    (real + ghost), with the model's GQA head counts and softmax scale."""
    _, num_pages, page_size, kv_heads, head_dim = cache.k.shape
    return RaggedVerifyAttention(max_rows, max_slots, int(cache.block_table.shape[1]), geometry.num_q_heads, kv_heads,
                                 head_dim, page_size, cache.k.device, cache.k.dtype, sm_scale=geometry.sm_scale,
                                 num_pages=num_pages)


class StepAttention:
    """The attention of one forward: plan once, then `(layer, q, k, v) -> out` per layer."""

    def __init__(self, attn: RaggedVerifyAttention, cache: PagedKVCache, layout: RaggedVerifyLayout,
                 prefix_lens: Tensor, block_table: Tensor):
        attn.plan(layout, prefix_lens, block_table)
        self.attn, self.cache = attn, cache
        self.positions = layout.positions(prefix_lens.to(cache.k.device))

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        write_kv(k, v, kc, vc, self.attn.kv_slots)
        return self.attn.run(q.contiguous(), kc, vc)
