"""CPU emulator of torch_npu's fused infer attention operator: for tests and the CPU bring-up ladder only.

`FusedInferAttentionEmulator` is a stand-in for `torch_npu.npu_fused_infer_attention_score` (FIA) with the
operator's keyword signature, implementing, in plain torch, the one path dspark's NPU backend calls: TND
queries (`[T, N, D]`, the ragged rows of every request packed), cumulative `actual_seq_lengths`, page
attention over a block table (`key` / `value` `[blocks, block_size, KV_N * D]` or `[blocks, KV_N,
block_size, D]`, per-request `actual_seq_lengths_kv`), GQA through `num_key_value_heads`, and
`sparse_mode=3` (rightDownCausal: a request's query rows are its last rows, so row j of n_q sees the first
`n_kv - n_q + j + 1` keys). It refuses, with an `FiaArgumentError` naming the argument and its value, what
the documented operator refuses (docs/ascend.md names the release): lengths that do not match the rows,
a KV length beyond the block table, a block size off the 128-multiples, a sparse mode without its mask.

`emulated_torch_npu()` is a stand-in `torch_npu` module for the CPU: this operator plus the NPU graph API
`NpuGraphBackend` calls; `EmulatedGraphBackend` is that backend with the emulated graph recording the
captured step, so a replay re-runs it after the backend's own task-group update windows.
Neither is ever a fast path.
"""
from __future__ import annotations

import importlib.machinery
import types
from typing import Callable, Sequence

import torch
from torch import Tensor

from dspark.ascend.graphs import NpuGraph, NpuGraphBackend

INT_MAX = 2**31 - 1
CAUSAL_MASK_SIZE = 2048          # sparse modes 2-4 take the operator's optimised 2048 x 2048 mask
MAX_TOKENS = 2**20               # TND: T <= 1M
MAX_BATCH = 65536
MAX_HEADS, MAX_HEAD_DIM, MAX_GQA_RATIO = 256, 512, 64
BLOCK_SIZES = (128, 256, 384, 512)  # page attention with Q_S > 1: 128 <= block_size <= 512, a multiple of 128
OPERATOR_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_LAYOUTS = ("TND",)      # the operator also takes BSH, BSND, BNSD, ...; dspark only calls TND
DOCUMENTED_LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND", "BSH_NBSD", "BSND_NBSD", "BNSD_NBSD", "TND",
                      "TND_NTD", "NTD_TND")


class FiaArgumentError(ValueError):
    """An argument the real fused infer attention operator refuses (or that dspark's TND path does not take)."""


def causal_mask(device: torch.device | str = "cpu") -> Tensor:
    """The operator's optimised causal mask for sparse modes 2-4: int8 [2048, 2048], 1 above the diagonal."""
    return torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.int8, device=device).triu_(1)


class FusedInferAttentionEmulator:
    """`torch_npu.npu_fused_infer_attention_score` on the CPU for the TND page-attention path (see the module).

    allow_float32: also take float32 query / key / value (the operator takes float16 / bfloat16 only): the CPU
    tests run float32 models and compare with dspark's float32 attention. `calls` counts the calls.
    """

    def __init__(self, allow_float32: bool = False) -> None:
        if not isinstance(allow_float32, bool):
            raise TypeError(f"allow_float32 must be a bool, got {allow_float32!r}")
        self.allow_float32 = allow_float32
        self.calls = 0

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, *, atten_mask: Tensor | None = None,
                 actual_seq_lengths: Sequence[int] | None = None, actual_seq_lengths_kv: Sequence[int] | None = None,
                 block_table: Tensor | None = None, num_heads: int = 1, scale: float = 1.0,
                 pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX, input_layout: str = "BSH",
                 num_key_value_heads: int = 0, sparse_mode: int = 0, inner_precise: int = 0, block_size: int = 0,
                 softmax_lse_flag: bool = False, **others: object) -> tuple[Tensor, Tensor]:
        """Attention of TND rows over a paged KV cache.

        Args:
            query: [T, num_heads, D]; key / value: [blocks, block_size, KV_N * D] or [blocks, KV_N, block_size, D].
            actual_seq_lengths: host ints, B cumulative query row ends (the last is T).
            actual_seq_lengths_kv: host ints, B per-request KV lengths (page attention: not cumulative).
            block_table: int32 [B, >= max blocks per request]; block_size: tokens per block.
            num_key_value_heads: KV_N (0: num_heads); scale: the softmax scale; sparse_mode: 0 (no mask)
                or 3 (rightDownCausal, with `causal_mask()`).
        Returns:
            (attention_out [T, num_heads, D] in query's dtype, softmax_lse [T, num_heads, 1] float32 when
            softmax_lse_flag else a zero [1]).
        """
        self.calls += 1
        given = {k for k, v in others.items() if v is not None}
        if given:
            raise FiaArgumentError(f"the emulated fused infer attention takes none of {sorted(given)} "
                                   f"(quantisation, padding, prefix, rope and pse are not on dspark's path)")
        b, kv_heads, d = _check_query(query, input_layout, num_heads, num_key_value_heads, self.allow_float32)
        q_ends = _check_lengths("actual_seq_lengths", actual_seq_lengths, None, cumulative=True)
        if q_ends[-1] != query.shape[0]:
            raise FiaArgumentError(f"actual_seq_lengths ends at {q_ends[-1]} but query has T={query.shape[0]} rows "
                                   f"(TND: the last cumulative length must equal T)")
        if len(q_ends) > MAX_BATCH:
            raise FiaArgumentError(f"actual_seq_lengths has {len(q_ends)} entries; the batch is at most {MAX_BATCH}")
        kv_lens = _check_lengths("actual_seq_lengths_kv", actual_seq_lengths_kv, len(q_ends), cumulative=False)
        causal = _check_sparse(sparse_mode, atten_mask, pre_tokens, next_tokens, inner_precise)
        keys, values = _check_paged(key, value, block_table, block_size, kv_lens, kv_heads, d, query)
        del b
        qf = query.float()
        out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        lse = torch.full(query.shape[:2], float("-inf"), dtype=torch.float32, device=query.device)
        group = num_heads // kv_heads
        start = 0
        for i, (end, n_kv) in enumerate(zip(q_ends, kv_lens)):
            n_q = end - start
            if n_q == 0 or n_kv == 0:
                start = end
                continue
            pages = block_table[i, : -(-n_kv // block_size)].long()
            k = keys[pages].reshape(-1, kv_heads, d)[:n_kv].float().repeat_interleave(group, dim=1)
            v = values[pages].reshape(-1, kv_heads, d)[:n_kv].float().repeat_interleave(group, dim=1)
            s = torch.einsum("qhd,khd->hqk", qf[start:end], k) * scale            # [N, n_q, n_kv]
            if causal:
                limit = n_kv - n_q + torch.arange(n_q, device=query.device)       # last key row j may see
                s = s.masked_fill(torch.arange(n_kv, device=query.device)[None, :] > limit[:, None], float("-inf"))
            m = s.amax(-1, keepdim=True)
            seen = torch.isfinite(m)                                              # rows with a visible key
            p = torch.where(seen, torch.exp(s - torch.where(seen, m, torch.zeros_like(m))), torch.zeros_like(s))
            denom = p.sum(-1, keepdim=True)
            o = torch.einsum("hqk,khd->qhd", p / denom.clamp_min(1e-30), v)
            out[start:end] = torch.where(seen.permute(1, 0, 2), o, torch.zeros_like(o))  # no key: 0
            lse[start:end] = (m + denom.log()).squeeze(-1).t()
            start = end
        lse_out = lse[..., None] if softmax_lse_flag else torch.zeros(1, dtype=torch.float32, device=query.device)
        return out.to(query.dtype), lse_out


def emulated_torch_npu(op: Callable[..., tuple[Tensor, Tensor]] | None = None) -> types.ModuleType:
    """A stand-in `torch_npu` module for the CPU: `npu_fused_infer_attention_score` is `op` (default a
    float32-accepting `FusedInferAttentionEmulator`), and `npu` holds the graph API `NpuGraphBackend` uses,
    whose graph replays what `EmulatedGraphBackend` recorded into it. Install it with
    `sys.modules["torch_npu"] = emulated_torch_npu()` (tests: `monkeypatch.setitem`); `npu.log` lists the
    graph calls in order."""
    log: list[str] = []

    class Graph:
        def __init__(self) -> None:
            self.recorded: Callable[[], None] | None = None

        def replay(self) -> None:
            log.append("replay")
            if self.recorded is None:
                raise RuntimeError("replay of an NPU graph that captured nothing")
            self.recorded()

    class GraphContext:
        """`with npu.graph(g, pool=...)`: the backend runs the step inside (`EmulatedGraphBackend` records it)."""

        def __init__(self, graph: Graph, pool: object = None) -> None:
            self.graph = graph

        def __enter__(self) -> "GraphContext":
            log.append("capture")
            return self

        def __exit__(self, *exc: object) -> None:
            log.append("capture_end")

    class ExternalEvent:
        def wait(self, stream: object) -> None:
            log.append("event_wait")

        def reset(self, stream: object) -> None:
            log.append("event_reset")

        def record(self, stream: object) -> None:
            log.append("event_record")

    class StreamContext:
        def __init__(self, stream: object) -> None:
            pass

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    def note(name: str, ret: object = None) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            log.append(name)
            return ret
        return call

    npu = types.SimpleNamespace(
        log=log, is_available=lambda: True, current_device=lambda: 0, get_device_name=lambda i: "emulated-cpu",
        graph_pool_handle=note("pool", "POOL"), NPUGraph=Graph, graph=GraphContext, current_stream=note("stream", "S0"),
        ExternalEvent=ExternalEvent, Stream=note("new_stream", "S1"), stream=StreamContext,
        graph_task_group_begin=note("group_begin"), graph_task_group_end=note("group_end", "HANDLE"),
        graph_task_update_begin=note("update_begin"), graph_task_update_end=note("update_end"),
        synchronize=note("synchronize"),
    )
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    mod.npu = npu
    mod.npu_fused_infer_attention_score = op if op is not None else FusedInferAttentionEmulator(allow_float32=True)
    return mod


class EmulatedGraphBackend(NpuGraphBackend):
    """`NpuGraphBackend` over `emulated_torch_npu()`: capture, task groups and update windows run the backend's
    own code; the emulated graph records the captured step, and a replay re-runs it."""

    def capture(self, fn: Callable[[], None], pool: object) -> NpuGraph:
        captured = super().capture(fn, pool)
        captured.graph.recorded = fn
        return captured


def _check_query(query: Tensor, layout: str, num_heads: int, kv_heads: int, allow_float32: bool
                 ) -> tuple[int, int, int]:
    if layout not in DOCUMENTED_LAYOUTS:
        raise FiaArgumentError(f"input_layout={layout!r} is not a layout of the operator ({', '.join(DOCUMENTED_LAYOUTS)})")
    if layout not in SUPPORTED_LAYOUTS:
        raise FiaArgumentError(f"input_layout={layout!r}: the emulator implements only dspark's TND path")
    if not isinstance(query, Tensor) or query.dim() != 3:
        raise FiaArgumentError(f"query must be TND [T, N, D], got "
                               f"{list(query.shape) if isinstance(query, Tensor) else type(query).__name__}")
    dtypes = OPERATOR_DTYPES + ((torch.float32,) if allow_float32 else ())
    if query.dtype not in dtypes:
        raise FiaArgumentError(f"query dtype {query.dtype} is not one of the operator's {list(OPERATOR_DTYPES)}")
    if not query.is_contiguous():
        raise FiaArgumentError("query must be contiguous (the operator takes no strided query)")
    t, n, d = query.shape
    if t > MAX_TOKENS:
        raise FiaArgumentError(f"query has T={t} rows; TND takes at most {MAX_TOKENS}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads != n:
        raise FiaArgumentError(f"num_heads={num_heads!r} must equal query's N={n}")
    if n > MAX_HEADS or d > MAX_HEAD_DIM or d % 16:
        raise FiaArgumentError(f"query [T, N={n}, D={d}]: the operator needs N <= {MAX_HEADS} and D <= "
                               f"{MAX_HEAD_DIM}, D a multiple of 16")
    kv = n if kv_heads == 0 else kv_heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv < 1 or n % kv or n // kv > MAX_GQA_RATIO:
        raise FiaArgumentError(f"num_key_value_heads={kv_heads!r}: num_heads={n} must be a multiple of it, "
                               f"at most {MAX_GQA_RATIO} times it")
    return t, kv, d


def _check_lengths(name: str, value: Sequence[int] | None, count: int | None, cumulative: bool) -> list[int]:
    if value is None:
        raise FiaArgumentError(f"{name} is required with input_layout TND and page attention")
    if isinstance(value, Tensor) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise FiaArgumentError(f"{name} must be a host list of ints, got {type(value).__name__}")
    out = list(value)
    if not out:
        raise FiaArgumentError(f"{name} is empty: it needs one entry per request")
    if count is not None and len(out) != count:
        raise FiaArgumentError(f"{name} has {len(out)} entries; actual_seq_lengths has {count} (the batch)")
    for i, x in enumerate(out):
        if x < 0:
            raise FiaArgumentError(f"{name}[{i}] = {x} is negative")
        if cumulative and i and x < out[i - 1]:
            raise FiaArgumentError(f"{name}[{i}] = {x} < {name}[{i - 1}] = {out[i - 1]}: TND lengths are cumulative "
                                   f"and must not decrease")
    return out


def _check_sparse(mode: int, mask: Tensor | None, pre_tokens: int, next_tokens: int, inner_precise: int) -> bool:
    """True for the causal (rightDownCausal) mode; TND takes sparse_mode 0 without a mask or 3 with one."""
    if inner_precise not in (0, 1, 2, 3):
        raise FiaArgumentError(f"inner_precise={inner_precise!r} is not one of 0, 1, 2, 3")
    if mode == 0:
        if mask is not None:
            raise FiaArgumentError("sparse_mode=0 with an atten_mask: TND takes sparse_mode 0 without a mask")
        if pre_tokens != INT_MAX or next_tokens != INT_MAX:
            raise FiaArgumentError(f"pre_tokens={pre_tokens} / next_tokens={next_tokens}: the emulator takes the "
                                   f"defaults only")
        return False
    if mode != 3:
        raise FiaArgumentError(f"sparse_mode={mode!r}: TND takes 0 (no mask) or 3 (rightDownCausal with its mask)")
    if not isinstance(mask, Tensor) or tuple(mask.shape[-2:]) != (CAUSAL_MASK_SIZE,) * 2 or mask.dim() > 4 \
            or any(s != 1 for s in mask.shape[:-2]):
        got = list(mask.shape) if isinstance(mask, Tensor) else mask
        raise FiaArgumentError(f"sparse_mode=3 needs the optimised atten_mask [{CAUSAL_MASK_SIZE}, "
                               f"{CAUSAL_MASK_SIZE}] (causal_mask()), got {got}")
    if mask.dtype not in (torch.bool, torch.int8, torch.uint8):
        raise FiaArgumentError(f"atten_mask dtype {mask.dtype} is not bool, int8 or uint8")
    return True


def _check_paged(key: Tensor, value: Tensor, table: Tensor | None, block_size: int, kv_lens: list[int],
                 kv_heads: int, d: int, query: Tensor) -> tuple[Tensor, Tensor]:
    """key / value as [blocks, block_size, KV_N, D] views after the page-attention checks."""
    if not isinstance(table, Tensor):
        raise FiaArgumentError("block_table is required: dspark's TND path is page attention")
    if table.dtype != torch.int32 or table.dim() != 2:
        raise FiaArgumentError(f"block_table must be int32 [B, max_blocks], got {table.dtype} {list(table.shape)}")
    if table.shape[0] != len(kv_lens):
        raise FiaArgumentError(f"block_table has {table.shape[0]} rows; the batch (actual_seq_lengths) has "
                               f"{len(kv_lens)}")
    if block_size not in BLOCK_SIZES:
        raise FiaArgumentError(f"block_size={block_size!r}: page attention takes 128 to 512, a multiple of 128")
    if not isinstance(key, Tensor) or not isinstance(value, Tensor) or key.shape != value.shape:
        raise FiaArgumentError(f"key and value must have the same shape, got {list(getattr(key, 'shape', []))} and "
                               f"{list(getattr(value, 'shape', []))}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise FiaArgumentError(f"key / value dtype {key.dtype} / {value.dtype} differ from query's {query.dtype}")
    if key.dim() == 3 and key.shape[1:] == (block_size, kv_heads * d):
        if kv_heads * d > 65535:
            raise FiaArgumentError(f"KV_N * D = {kv_heads * d} > 65535 in the [blocks, block_size, H] cache layout")
        keys, values = key.view(key.shape[0], block_size, kv_heads, d), value.view(key.shape[0], block_size, kv_heads, d)
    elif key.dim() == 4 and key.shape[1:] == (kv_heads, block_size, d):
        keys, values = key.transpose(1, 2), value.transpose(1, 2)
    else:
        raise FiaArgumentError(f"key {list(key.shape)} is not a paged cache [blocks, {block_size}, {kv_heads * d}] or "
                               f"[blocks, {kv_heads}, {block_size}, {d}] (block_size, num_key_value_heads, D)")
    need = [-(-n // block_size) for n in kv_lens]
    for i, n in enumerate(need):
        if n > table.shape[1]:
            raise FiaArgumentError(f"actual_seq_lengths_kv[{i}] = {kv_lens[i]} needs {n} blocks of {block_size}; "
                                   f"block_table has {table.shape[1]} columns")
    if sum(need) > key.shape[0]:
        raise FiaArgumentError(f"the requests need {sum(need)} blocks; the cache has {key.shape[0]}")
    used = torch.arange(table.shape[1], device=table.device)[None, :] < torch.tensor(need, device=table.device)[:, None]
    bad = used & ((table < 0) | (table >= key.shape[0]))
    if bool(bad.any()):
        r, c = (int(x) for x in bad.nonzero()[0])
        raise FiaArgumentError(f"block_table[{r}, {c}] = {int(table[r, c])} is not a block of the {key.shape[0]}-block cache")
    return keys, values
