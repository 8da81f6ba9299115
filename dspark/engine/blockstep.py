"""A small transformer-block verify step over packed rows: the built-in step the tier sweep profiles.

One pre-norm block (multi-head attention over each request's cached context plus causal attention over
its own verify rows, then an MLP) and an LM head, reading `StepBuffers` so that `TierGraphRunner` can
capture it per tier. Real rows write their K/V to `slot * capacity + position`; padding rows (ghost
slots, `row_valid` False) write to one dummy row past the cache, so they never touch a request's KV.
It is a synthetic step with its own flat KV layout, not the engine's: the engine's verify forward (a
transformers model over the paged cache, `dspark.models`) does not yet run through `TierGraphRunner`, so
the tier sweep and the graph-runner tests still capture this block. A user's model plugs into the sweep
through `dspark.engine.sweep.StepAdapter`.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark.util.validate import check_int
from dspark.verify.graphs import GraphBackend, RowSpec, StepBuffers, TierGraphRunner


class BlockVerifyStep:
    """One transformer block + LM head over packed verify rows, with a per-slot KV cache."""

    def __init__(self, *, width: int, num_slots: int, max_context: int = 32, hidden: int = 64,
                 heads: int = 4, vocab: int = 128, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        for name, v in (("width", width), ("num_slots", num_slots), ("max_context", max_context),
                        ("hidden", hidden), ("heads", heads), ("vocab", vocab)):
            check_int(name, v, 1)
        if hidden % heads:
            raise ValueError(f"hidden {hidden} must be a multiple of heads {heads}")
        gen = torch.Generator().manual_seed(seed)

        def weight(*shape: int) -> Tensor:
            return (torch.randn(*shape, generator=gen) / shape[0] ** 0.5).to(device=device, dtype=dtype)

        self.width, self.num_slots, self.max_context = width, num_slots, max_context
        self.hidden, self.heads = hidden, heads
        self.capacity = max_context + width
        self.w_qkv, self.w_o = weight(hidden, 3 * hidden), weight(hidden, hidden)
        self.w_up, self.w_down = weight(hidden, 4 * hidden), weight(4 * hidden, hidden)
        self.w_head = weight(hidden, vocab)
        cache_rows = num_slots * self.capacity + 1  # + the dummy row padding rows write to
        self.cache_k = (torch.randn(cache_rows, hidden, generator=gen) * 0.5).to(device=device, dtype=dtype)
        self.cache_v = (torch.randn(cache_rows, hidden, generator=gen) * 0.5).to(device=device, dtype=dtype)
        self.dummy_row = cache_rows - 1
        self.row_inputs: dict[str, RowSpec] = {"hidden": ((hidden,), dtype), "positions": ((), torch.int64)}

    def __call__(self, bufs: StepBuffers) -> Tensor:
        x, pos = bufs.rows["hidden"], bufs.rows["positions"]
        n, d, h = x.shape[0], self.hidden, self.heads
        slot, within = bufs.row_slot.to(torch.int64), bufs.row_within.to(torch.int64)
        valid = bufs.row_valid
        q, k, v = (F.layer_norm(x, (d,)) @ self.w_qkv).split(d, dim=-1)
        prefix = pos - within                                                  # cached context of the row's request
        ctx = torch.arange(self.max_context, device=x.device)
        ctx_idx = slot[:, None] * self.capacity + ctx[None, :]                # [n, C]
        kc = self.cache_k.index_select(0, ctx_idx.reshape(-1)).reshape(n, -1, h, d // h)
        vc = self.cache_v.index_select(0, ctx_idx.reshape(-1)).reshape(n, -1, h, d // h)
        qh, kh, vh = q.reshape(n, h, -1), k.reshape(n, h, -1), v.reshape(n, h, -1)
        scale = (d // h) ** -0.5
        neg = torch.finfo(x.dtype).min
        s_ctx = torch.einsum("rhd,rchd->rhc", qh, kc) * scale
        s_ctx = s_ctx.masked_fill(~(ctx[None, :] < prefix[:, None])[:, None, :], neg)
        causal = (slot[:, None] == slot[None, :]) & (within[None, :] <= within[:, None])
        s_ver = torch.einsum("rhd,thd->rht", qh, kh).mul(scale).masked_fill(~causal[:, None, :], neg)
        p = torch.softmax(torch.cat([s_ctx, s_ver], dim=-1), dim=-1)
        c = self.max_context
        o = torch.einsum("rhc,rchd->rhd", p[..., :c], vc) + torch.einsum("rht,thd->rhd", p[..., c:], vh)
        x = x + o.reshape(n, d) @ self.w_o
        x = x + F.gelu(F.layer_norm(x, (d,)) @ self.w_up) @ self.w_down
        dst = torch.where(valid, slot * self.capacity + pos, torch.full_like(pos, self.dummy_row))
        self.cache_k.index_copy_(0, dst, k)
        self.cache_v.index_copy_(0, dst, v)
        return F.layer_norm(x, (d,)) @ self.w_head


def split_rows(num_requests: int, rows: int, width: int) -> list[int]:
    """verify_lens with `rows` in total spread as evenly as possible over `num_requests` (each in [1, W])."""
    if num_requests < 1 or not num_requests <= rows <= num_requests * width:
        raise ValueError(f"rows={rows} must lie in [B, B*W] = [{num_requests}, {num_requests * width}]")
    q, r = divmod(rows, num_requests)
    return [q + 1] * r + [q] * (num_requests - r)


class BlockVerifyAdapter:
    """`dspark.engine.sweep.StepAdapter` for `BlockVerifyStep` run through a `TierGraphRunner` (eager tiers on the CPU)."""

    def __init__(self, *, tiers: Sequence[int], width: int, max_requests: int,
                 device: torch.device | str = "cpu", backend: GraphBackend | None = None,
                 context: int = 32, hidden: int = 64, seed: int = 0) -> None:
        self.device = torch.device(device)
        self.name = f"block-d{hidden}-ctx{context}"
        slots = max_requests + -(-max(tiers) // width)  # room for any padding of any tier
        self.model = BlockVerifyStep(width=width, num_slots=slots, max_context=context, hidden=hidden,
                                     device=self.device, seed=seed)
        self.runner = TierGraphRunner(self.model, tiers, slots, self.device, backend, width=width,
                                      row_inputs=self.model.row_inputs, model_id=self.name).capture()
        self.context, self.width, self.max_requests = context, width, max_requests
        self._gen = torch.Generator().manual_seed(seed)
        self._step: tuple | None = None

    def prepare(self, num_requests: int, rows: int) -> None:
        if num_requests > self.max_requests:
            raise ValueError(f"num_requests={num_requests} exceeds max_requests={self.max_requests}")
        layout = self.runner.layout(split_rows(num_requests, rows, self.width))
        prefix = torch.full((num_requests,), self.context, dtype=torch.int64)
        hidden = torch.randn(rows, self.model.hidden, generator=self._gen).to(self.device)
        self._step = (layout, hidden, layout.positions(prefix.to(self.device))[:rows])

    def step(self) -> None:
        if self._step is None:
            raise RuntimeError("call prepare(num_requests, rows) before step()")
        layout, hidden, positions = self._step
        self.runner.run(layout, hidden=hidden, positions=positions)
