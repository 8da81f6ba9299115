"""Per-step attention for the engine's forward: KV writes for real rows, then paged ragged attention.

Built once per forward from the step's `RaggedVerifyLayout` and the requests' prefix lengths; the model
calls it once per layer. Padding rows (ghost slots) never write the cache and their outputs are unused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark.engine.kv_cache import PagedKVCache
from dspark.layout import RaggedVerifyLayout


class StepAttention:
    """Attention plan for one forward over `layout.graph_num_tokens` packed rows."""

    def __init__(self, layout: RaggedVerifyLayout, prefix_lens: Tensor, cache: PagedKVCache, max_len: int):
        self.cache = cache
        self.layout = layout
        self.positions = layout.positions(prefix_lens)
        real = layout.total_rows
        self.real_rows = real
        req = layout.row_slot[:real].long()
        self.write_slots = cache.slot_index(req, self.positions[:real])
        # Temporary dense-gather core until dspark.attention lands: queries padded to [B, Wq].
        b = layout.num_requests
        self.wq = int(layout.width or (int(layout.verify_lens.max()) if b else 1))
        self.row_req = req
        self.row_within = layout.row_within[:real].long()
        keys = torch.arange(max_len, device=prefix_lens.device)
        self.kv_slots = cache.slot_index(
            torch.arange(b, device=prefix_lens.device)[:, None].expand(b, max_len), keys[None, :].expand(b, max_len)
        )
        qpos = prefix_lens.long()[:, None] + torch.arange(self.wq, device=prefix_lens.device)[None, :]
        self.mask = keys[None, None, :] <= qpos[:, :, None]  # [B, Wq, L]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        real = self.real_rows
        self.cache.write(layer, self.write_slots, k[:real], v[:real])
        kf, vf = self.cache.flat(layer)
        b, L = self.kv_slots.shape
        kk = kf.index_select(0, self.kv_slots.reshape(-1)).reshape(b, L, *kf.shape[1:])
        vv = vf.index_select(0, self.kv_slots.reshape(-1)).reshape(b, L, *vf.shape[1:])
        qq = q.new_zeros(b, self.wq, *q.shape[1:])
        qq[self.row_req, self.row_within] = q[:real]
        o = F.scaled_dot_product_attention(
            qq.transpose(1, 2), kk.to(q.dtype).transpose(1, 2), vv.to(q.dtype).transpose(1, 2),
            attn_mask=self.mask[:, None],
        ).transpose(1, 2)
        out = q.new_zeros(q.shape)
        out[:real] = o[self.row_req, self.row_within]
        return out
