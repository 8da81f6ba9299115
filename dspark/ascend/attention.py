"""The NPU attention backend: ragged verify (and prefill) rows through the Ascend fused infer attention operator.

`NpuVerifyAttention` has the plan / launch interface of `dspark.RaggedVerifyAttention`, so
`dspark.models.PagedAttend` / `PlannedAttend` and the engine's `VerifyStep` drive it unchanged; a target
selects it with `use_npu_attention(target)` (the engine builds every attention of that target from its
`attention_backend`). `plan(layout, prefix_lens, block_table)` builds the step's `AscendVerifyMetadata`
once from the layout and the KV state; every layer then writes its K/V rows with dspark's `write_kv`
(padding rows write nothing) and `launch` calls

    npu_fused_infer_attention_score(q [T, Hq, D], k_cache, v_cache viewed [pages, page_size, Hkv * D],
        input_layout="TND", actual_seq_lengths=<cumulative query ends, host>, actual_seq_lengths_kv=<L + v,
        host>, block_table=[S, P] int32, block_size=page_size, num_heads=Hq, num_key_value_heads=Hkv,
        scale=sm_scale, sparse_mode=3, atten_mask=<the 2048 x 2048 causal mask>)

T is the step's packed rows (the tier in a graph): the cumulative lengths end at T; ghost slots carry the
padding rows with KV length 1 over the dummy page 0, and their outputs are never read. Inside an
`NpuGraphBackend` capture the call is issued through `backend.updatable`, so every replay re-issues it with
the step's host lists. The operator is torch_npu's (imported on first launch) unless `op` is given: the CPU
emulator (`dspark.ascend.emulator`) in tests and the CPU bring-up ladder.
"""
from __future__ import annotations

import contextlib
import functools
import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor

from dspark.ascend import runtime
from dspark.ascend.emulator import causal_mask
from dspark.ascend.metadata import AscendVerifyMetadata
from dspark.util.validate import check_tensor, check_type
from dspark.verify.attention import AttentionShape, RaggedVerifyAttention
from dspark.verify.layout import RaggedVerifyLayout

FiaOp = Callable[..., tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class NpuAttentionPlan:
    """One planned step: its Ascend metadata and the operator's device inputs (views of persistent buffers)."""

    metadata: AscendVerifyMetadata
    prefix_lens: Tensor   # [S] int32 cached tokens per slot before the step (ghosts 0)
    block_table: Tensor   # [S, max_pages_per_slot] int32 (ghost rows: the dummy page 0)


class NpuVerifyAttention:
    """Persistent metadata + launcher of the fused infer attention over a paged KV cache (module docstring).

    The constructor takes `RaggedVerifyAttention`'s arguments (capture-time maxima, GQA heads, page size,
    device, dtype; `num_kv_splits` is the Triton kernel's and is ignored here) plus `op` (the operator;
    default torch_npu's) and `graph_backend` (an `NpuGraphBackend` whose captures this attention runs in).
    The block table passed to the operator has the plan's `max_pages_per_slot` columns (>= every request's
    blocks, as the operator requires).
    """

    def __init__(self, shape: AttentionShape, device: torch.device | str, dtype: torch.dtype, *,
                 op: FiaOp | None = None, graph_backend: object = None) -> None:
        if op is not None and not callable(op):
            raise TypeError(f"op must be the fused infer attention operator (callable), got {type(op).__name__}")
        # the step geometry (checks, block table, KV write slots) is planned exactly as dspark's default
        # attention plans it; only the attention call differs
        self._geometry = RaggedVerifyAttention(dataclasses.replace(shape, num_kv_splits=1), device, dtype)
        self.device, self.dtype, self.sm_scale = self._geometry.device, dtype, self._geometry.sm_scale
        self.num_q_heads, self.num_kv_heads, self.head_dim = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
        self.page_size = shape.page_size
        self.op, self.graph_backend = op, graph_backend
        self._mask = causal_mask(self.device)
        self._plan: NpuAttentionPlan | None = None
        self._host_q: list[int] = []
        self._host_kv: list[int] = []

    @property
    def meta(self) -> NpuAttentionPlan:
        """The planned step (`prefix_lens` is what `PagedAttend` reads for the rows' positions)."""
        if self._plan is None:
            raise RuntimeError("no plan yet: call plan(layout, prefix_lens, block_table) first")
        return self._plan

    @property
    def num_rows(self) -> int:
        """Packed rows of the planned step."""
        return self._geometry.num_rows

    @property
    def kv_slots(self) -> Tensor:
        """[planned rows] int64 flat cache slot of each row (-1 for padding rows): feed `write_kv`."""
        return self._geometry.kv_slots

    def plan(self, layout: RaggedVerifyLayout, prefix_lens: Tensor | Sequence[int], block_table: Tensor,
             metadata: AscendVerifyMetadata | None = None) -> None:
        """Host side, once per step: check the geometry (as `RaggedVerifyAttention.plan`), build (or check
        `metadata` against) the step's `AscendVerifyMetadata`, and keep the operator's host lists.

        prefix_lens [B]: cached tokens per request before its rows; block_table [B, P]: its pages;
        metadata: the step's metadata when the caller built it already (it must be this layout's, over
        these prefix lengths).
        """
        self._geometry.plan(layout, prefix_lens, block_table)
        planned = self._geometry.meta
        s = layout.num_slots
        prefix = planned.prefix_lens[: layout.num_requests].to(torch.int64)
        if metadata is None:
            metadata = AscendVerifyMetadata.from_layout(layout, prefix.to(layout.qo_indptr.device), (), slots=s)
        else:
            check_metadata(metadata, layout, prefix.cpu())
        self._host_q, self._host_kv = list(metadata.actual_seq_lengths_q_host), list(metadata.seq_lens_kv_host)
        self._plan = NpuAttentionPlan(metadata, planned.prefix_lens[:s], planned.block_table[:s])

    def check_cache(self, k_cache: Tensor, v_cache: Tensor) -> None:
        """k_cache / v_cache [pages, page_size, Hkv, D] (or with a leading layers dim) of this plan's geometry,
        dtype and device (`RaggedVerifyAttention.check_cache`)."""
        self._geometry.check_cache(k_cache, v_cache)

    def run(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor | None = None) -> Tensor:
        """Attention of the planned step with its checks: q [rows, Hq, D] -> out [rows, Hq, D]."""
        plan = self.meta
        check_tensor("q", q)
        if tuple(q.shape) != (plan.metadata.num_tokens, self.num_q_heads, self.head_dim):
            raise ValueError(f"q must be [{plan.metadata.num_tokens}, {self.num_q_heads}, {self.head_dim}] (the "
                             f"planned metadata's rows), got {list(q.shape)}")
        self.check_cache(k_cache, v_cache)
        if k_cache.dim() != 4:
            raise ValueError(f"run takes one layer's cache [pages, page_size, Hkv, D], got {list(k_cache.shape)}")
        return self.launch(q.contiguous(), k_cache, v_cache, out)

    def launch(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor | None = None) -> Tensor:
        """`run` without its checks: the per-layer call of a forward (one layer's cache, q of the planned rows).
        In an `NpuGraphBackend` capture the operator becomes a task group re-issued before every replay."""
        if out is None:
            out = torch.empty_like(q)
        pages = k_cache.shape[0]
        key = k_cache.view(pages, self.page_size, self.num_kv_heads * self.head_dim)
        value = v_cache.view(pages, self.page_size, self.num_kv_heads * self.head_dim)
        table = self.meta.block_table

        def issue() -> None:  # reads the host lists of the latest plan: a re-issue picks up the new step's
            op = self.op if self.op is not None else runtime.torch_npu().npu_fused_infer_attention_score
            result, _ = op(q, key, value, atten_mask=self._mask, block_table=table, input_layout="TND",
                           block_size=self.page_size, actual_seq_lengths=self._host_q,
                           actual_seq_lengths_kv=self._host_kv, num_heads=self.num_q_heads,
                           num_key_value_heads=self.num_kv_heads, scale=self.sm_scale, sparse_mode=3)
            out.copy_(result)

        if self.graph_backend is not None:
            self.graph_backend.updatable(issue)
        else:
            issue()
        return out


def check_metadata(metadata: AscendVerifyMetadata, layout: RaggedVerifyLayout, prefix_lens: Tensor) -> None:
    """ValueError naming the first field of `metadata` that is not `layout`'s over `prefix_lens` [B]."""
    check_type("metadata", metadata, AscendVerifyMetadata)
    s = layout.num_slots
    cu = layout.slot_qo_indptr.cpu().to(torch.int64).tolist()
    kv = (prefix_lens.to(torch.int64) + layout.verify_lens.cpu().to(torch.int64)).tolist()
    for name, got, want in (
            ("num_tokens", metadata.num_tokens, layout.graph_num_tokens),
            ("num_requests", metadata.num_requests, layout.num_requests),
            ("cu_seqlens_q_host", metadata.cu_seqlens_q_host[: len(cu)], cu),
            ("seq_lens_kv_host", metadata.seq_lens_kv_host[: len(kv)], kv)):
        if got != want:
            raise ValueError(f"metadata.{name} = {got} is not this layout's {want} (metadata from another layout "
                             f"or other prefix lengths)")
    if metadata.num_slots < s:
        raise ValueError(f"metadata.num_slots = {metadata.num_slots} < the layout's {s} slots")


def use_npu_attention(target: torch.nn.Module, op: FiaOp | None = None, graph_backend: object = None) -> None:
    """Select the NPU backend for `target` (a `dspark.models.TransformersCausalLM`): the engine builds every
    attention of its forwards (prefill, plain, verify, tier graphs) as `NpuVerifyAttention(op=op,
    graph_backend=graph_backend)`. `op=None`: torch_npu's operator. `target.attention_backend = None`
    selects dspark's default attention again."""
    if not hasattr(target, "attention_backend"):
        raise TypeError(f"target must be a dspark.models.TransformersCausalLM, got {type(target).__name__}")
    target.attention_backend = functools.partial(NpuVerifyAttention, op=op, graph_backend=graph_backend)


@contextlib.contextmanager
def npu_attention(target: torch.nn.Module, op: FiaOp | None = None, graph_backend: object = None) -> Iterator[None]:
    """`use_npu_attention` for the duration; the target's previous backend is restored on exit."""
    before = getattr(target, "attention_backend", None)
    use_npu_attention(target, op, graph_backend)
    try:
        yield
    finally:
        target.attention_backend = before
