"""Tiny byte-level decoder-only transformers: the target and a smaller draft with a confidence head.

One forward serves every inference step: packed rows (prefill, draft or ragged verify) with their
absolute positions, a paged KV cache, and an attention plan built once per step from the step's
`RaggedVerifyLayout`. A second, dense causal path (`forward_dense`) is used only for training.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark.confidence import ConfidenceHead, previous_tokens

Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]  # (layer, q, k, v) -> out, all [..., H, D]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of one tiny transformer (vocabulary = bytes by default)."""

    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 128
    vocab_size: int = 256
    mlp_mult: int = 4

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "max_seq_len", "vocab_size", "mlp_mult"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"d_model={self.d_model} must split into {self.n_heads} heads of even size"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


def _rope_tables(cfg: ModelConfig) -> tuple[Tensor, Tensor]:
    half = cfg.head_dim // 2
    inv = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
    ang = torch.arange(cfg.max_seq_len, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (first half, second half) of the head dim; cos/sin broadcast over heads."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(nn.Module):
    """Pre-norm attention + MLP block; the attention core is supplied by the caller."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_mult * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_mult * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        q, k, v = self.project(x, cos, sin)
        return self.finish(x, attend(self.layer, q, k, v))

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v [..., H, D] with RoPE applied (dense: the part `compile_dense` compiles)."""
        shape = x.shape[:-1] + (self.cfg.n_heads, self.cfg.head_dim)
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        return apply_rope(q.reshape(shape), cos, sin), apply_rope(k.reshape(shape), cos, sin), v.reshape(shape)

    def finish(self, x: Tensor, o: Tensor) -> Tensor:
        """Output projection and MLP after attention (dense)."""
        x = x + self.proj(o.reshape(x.shape))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Byte-level decoder-only transformer with RoPE and a tied output embedding."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        cos, sin = _rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        """Hidden states [N, d] for packed rows `tokens [N]` at absolute `positions [N]`."""
        cos = self.rope_cos.index_select(0, positions)[:, None, :]
        sin = self.rope_sin.index_select(0, positions)[:, None, :]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin, attend)
        return self.norm(x)

    def forward_dense(self, tokens: Tensor) -> Tensor:
        """Training path: hidden states [b, T, d] for full causal sequences `tokens [b, T]`."""
        t = tokens.shape[1]
        cos, sin = self.rope_cos[:t, None, :], self.rope_sin[:t, None, :]

        def causal(_layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
            return o.transpose(1, 2)

        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin, causal)
        return self.norm(x)

    def logits(self, hidden: Tensor) -> Tensor:
        return hidden @ self.embed.weight.t()

    def compile_dense(self) -> None:
        """torch.compile (dynamic shapes) the dense parts of every block; attention stays eager because
        its plan/run already does no per-step host work and its shapes change every step."""
        for block in self.blocks:
            block.project = torch.compile(block.project, dynamic=True)
            block.finish = torch.compile(block.finish, dynamic=True)


class DraftLM(TinyLM):
    """The draft: a smaller TinyLM whose last hidden state proposes a whole block of gamma drafts at once.

    Head k (a residual MLP) turns the hidden state of the last committed token into `h_k`, which gives
    the distribution of the token k + 1 places ahead (tied output embedding) and, through the shared
    ConfidenceHead, draft k's confidence logit. One draft forward per step whatever gamma is, and draft
    k's confidence never depends on draft k's own token (DESIGN.md 4.4).
    """

    def __init__(self, cfg: ModelConfig, gamma: int, markov_rank: int = 0):
        super().__init__(cfg)
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"gamma must be a positive int, got {gamma!r}")
        self.gamma = gamma
        self.heads = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(cfg.d_model), nn.Linear(cfg.d_model, cfg.d_model), nn.GELU())
            for _ in range(gamma)
        )
        self.confidence = ConfidenceHead(cfg.d_model, markov_rank, cfg.vocab_size if markov_rank else None)

    def block_hidden(self, hidden: Tensor, k: int) -> Tensor:
        """[..., d] -> [..., k, d]: the hidden state of each of the first k draft positions.

        All k heads in one batched pass (one layer norm, one batched matmul) instead of k module calls:
        the same math, a fraction of the per-step host overhead.
        """
        norms, linears = [h[0] for h in self.heads[:k]], [h[1] for h in self.heads[:k]]
        x = F.layer_norm(hidden, (self.cfg.d_model,), eps=norms[0].eps).unsqueeze(-2)        # [..., 1, d]
        x = x * torch.stack([n.weight for n in norms]) + torch.stack([n.bias for n in norms])  # [..., k, d]
        w = torch.stack([lin.weight for lin in linears])                                       # [k, out, in]
        y = (x.unsqueeze(-2) @ w.transpose(1, 2)).squeeze(-2) + torch.stack([lin.bias for lin in linears])
        return hidden.unsqueeze(-2) + F.gelu(y)

    def confidence_logits(self, hk: Tensor, anchor: Tensor, drafts: Tensor) -> Tensor:
        """[..., k] confidence logits from the block's hidden states hk [..., k, d]; with a previous-token
        head, draft j also sees the token before it (anchor [...] = last committed token for j = 0, then
        drafts [..., k]), never its own."""
        k = hk.shape[-2]
        flat = hk.reshape(-1, k, hk.shape[-1])
        prev = (previous_tokens(anchor.reshape(-1), drafts.reshape(-1, k))
                if self.confidence.markov_rank else None)
        return self.confidence(flat, prev).reshape(hk.shape[:-1])

    def propose(self, hidden: Tensor, k: int, anchor: Tensor) -> tuple[Tensor, Tensor]:
        """Greedy block: draft logits [B, k, V] and confidence logits [B, k] from the last hidden state [B, d]
        and the last committed token anchor [B]."""
        hk = self.block_hidden(hidden, k)
        logits = self.logits(hk)
        return logits, self.confidence_logits(hk, anchor, logits.argmax(-1))
