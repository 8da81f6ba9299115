"""PagedAttend: the `attend(layer, q, k, v)` of one forward over a paged KV cache.

Built once per forward from the step's `RaggedVerifyLayout` (this plans the persistent
`RaggedVerifyAttention`); each layer then writes its K/V rows into the cache (`write_kv`; padding rows
carry slot -1 and write nothing) and runs the planned attention. Prefill, draft and verify forwards
share it; `positions` are the rows' absolute positions for the model's `position_ids`. `PlannedAttend`
is the per-layer part alone, for a step captured in a graph whose attention is planned before each replay.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from dspark.kernels import kv_write as _kv
from dspark.verify.attention import RaggedVerifyAttention
from dspark.verify.layout import RaggedVerifyLayout


class PlannedAttend:
    """`(layer, q [N, Hq, D], k, v [N, Hkv, D]) -> out [N, Hq, D]` with `attn` as last planned: no host work.

    k_cache / v_cache: `[num_layers, num_pages, page_size, Hkv, D]`, checked here once against the plan's
    geometry; the per-layer calls check nothing (the model hands in its own layer's rows) and stay out of
    compiled graphs (`torch.compiler.disable`: the kernel is the fast path, its launch code not for Dynamo).
    """

    def __init__(self, attn: RaggedVerifyAttention, k_cache: Tensor, v_cache: Tensor):
        if not isinstance(k_cache, Tensor) or k_cache.dim() != 5:
            raise ValueError(f"k_cache must be [layers, pages, page_size, Hkv, D], got "
                             f"{list(getattr(k_cache, 'shape', [k_cache]))}")
        attn.check_cache(k_cache, v_cache)
        self.attn, self.k_cache, self.v_cache = attn, k_cache, v_cache
        self.sm_scale = attn.sm_scale

    @torch.compiler.disable
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        _kv.write_kv(k, v, kc, vc, self.attn.kv_slots)
        return self.attn.launch(q.contiguous(), kc, vc)


class PagedAttend(PlannedAttend):
    """Plan `attn` for one forward, then attend as `PlannedAttend`.

    prefix_lens [B]: tokens already in the cache per request; block_table [B, P]: each request's pages.
    """

    def __init__(self, attn: RaggedVerifyAttention, k_cache: Tensor, v_cache: Tensor, layout: RaggedVerifyLayout,
                 prefix_lens: Tensor | Sequence[int], block_table: Tensor):
        super().__init__(attn, k_cache, v_cache)
        attn.plan(layout, prefix_lens, block_table)
        self.positions = layout.positions(attn.meta.prefix_lens[: layout.num_requests])  # the planned copy
