"""ModelGeometry: the shape facts the engine sizes its KV caches and attention plans from."""
from __future__ import annotations

import math
from dataclasses import dataclass

from dspark.util.validate import check_int


@dataclass(frozen=True)
class ModelGeometry:
    """KV and vocabulary geometry of one causal LM (GQA: `num_q_heads` is a multiple of `num_kv_heads`).

    A paged cache for this model is `[num_layers, pages, page_size, num_kv_heads, head_dim]`; its
    `RaggedVerifyAttention` takes `num_q_heads`, `num_kv_heads`, `head_dim` and `sm_scale` from here.
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_seq_len: int
    sm_scale: float

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size",
                     "max_seq_len"):
            check_int(name, getattr(self, name), 1)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads={self.num_q_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if not isinstance(self.sm_scale, float) or not math.isfinite(self.sm_scale) or self.sm_scale <= 0:
            raise ValueError(f"sm_scale must be a finite float > 0, got {self.sm_scale!r}")
