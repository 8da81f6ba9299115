"""NPU graph backend for `dspark.verify.graphs.TierGraphRunner`: one torch_npu graph per token tier.

Device buffers are refreshed by plain copies before replay, as on CUDA. What a captured NPU graph cannot
see through buffers are host-side operator parameters: the fused attention ops take the cumulative query
and KV lengths as host lists (`actual_seq_lengths_q`, `actual_seq_lengths_kv`). Ops that read such lists
are issued through `updatable(op)` during capture; each becomes a graph task group, and before every
replay the backend re-issues it between `graph_task_update_begin/end` on an update stream, so it picks
up the step's host lists. Ordering uses the group's external event, never a host sync.

The runner's `update` (device-buffer copies) runs before the update windows, not inside them: work
issued between `graph_task_update_begin/end` is taken as the replacement of the captured task, so only
the re-issued op belongs there. A step per tier: build `AscendVerifyMetadata.from_layout(layout, live)`,
`buffers[tier].load(meta)` (device tensors in place, host lists swapped), then `runner.run(layout, ...)`;
the updatable ops read `buffers[tier].host`. torch_npu is imported on first use.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import Tensor

from dspark.ascend import runtime
from dspark.ascend.capability import NpuVerifyConfig, RaggedGraphCapability
from dspark.ascend.metadata import AscendVerifyMetadata
from dspark.util.validate import check_int
from dspark.verify.graphs import register_graph_backend


@dataclass
class TaskGroup:
    """A captured op whose host-side parameters are re-read at each replay."""

    handle: object              # torch_npu task-group handle (graph_task_group_end)
    event: object               # ExternalEvent: the graph waits on it, the update records it
    reissue: Callable[[], None]  # the same op with the same output buffers, reading fresh host lists


@dataclass
class NpuGraph:
    """A captured tier: the NPUGraph and its updatable task groups, in capture order."""

    graph: object
    task_groups: list[TaskGroup] = field(default_factory=list)


class NpuGraphBackend:
    """`GraphBackend` on torch_npu: NPUGraph capture into a shared pool; replay refreshes host params."""

    name = "npu"
    static_outputs = True

    def __init__(self, device: object = None, warmup: int = 1,
                 capability: RaggedGraphCapability | None = None) -> None:
        check_int("warmup", warmup, 0)
        self.device = device
        self.warmup = warmup
        self.capability = capability if capability is not None else RaggedGraphCapability()
        self._capturing: NpuGraph | None = None
        self._update_stream: object = None

    def new_pool(self) -> object:
        return runtime.torch_npu().npu.graph_pool_handle()

    def capture(self, fn: Callable[[], None], pool: object) -> NpuGraph:
        """Warm up eagerly, then capture `fn` (which may call `updatable`) into `pool`."""
        npu = runtime.torch_npu().npu
        if self._capturing is not None:
            raise RuntimeError("NpuGraphBackend.capture is not reentrant")
        for _ in range(self.warmup):
            fn()
        captured = NpuGraph(npu.NPUGraph())
        self._capturing = captured
        try:
            with npu.graph(captured.graph, pool=pool):
                fn()
        finally:
            self._capturing = None
        return captured

    def updatable(self, op: Callable[[], None]) -> None:
        """Issue `op`; inside a capture it becomes a task group re-issued before every replay."""
        if self._capturing is None:
            op()
            return
        npu = runtime.torch_npu().npu
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        op()
        self._capturing.task_groups.append(TaskGroup(npu.graph_task_group_end(stream), event, op))

    def replay(self, graph: object, update: Callable[[], None] | None = None) -> None:
        """`update()` (buffer copies, host-list refresh) runs first on the current stream; then every
        task group is re-issued inside its update window; then the graph replays. No host sync."""
        if not isinstance(graph, NpuGraph):
            raise TypeError(f"graph must come from NpuGraphBackend.capture, got {type(graph).__name__}")
        npu = runtime.torch_npu().npu
        if update is not None:
            update()
        if graph.task_groups:
            if self._update_stream is None:
                self._update_stream = npu.Stream()
            stream = self._update_stream
            with npu.stream(stream):
                for group in graph.task_groups:
                    npu.graph_task_update_begin(stream, group.handle)
                    group.reissue()
                    npu.graph_task_update_end(stream)
                    group.event.record(stream)
        graph.graph.replay()

    def synchronize(self) -> None:
        runtime.torch_npu().npu.synchronize()

    def supports_ragged_verify_graph(self, config: NpuVerifyConfig) -> bool:
        """True only for configurations whose eager and graph equivalence checks were recorded as passed."""
        return self.capability.supports_ragged_verify_graph(config)


class VerifyMetadataBuffers:
    """Static per-tier home of `AscendVerifyMetadata`: device tensors a graph captured, refreshed in
    place by `load`, and the host lists that `updatable` ops read when re-issued."""

    def __init__(self, template: AscendVerifyMetadata) -> None:
        self.tensors = {name: t.clone() for name, t in _tensors(template).items()}
        self.geometry = _geometry(template)
        self.host = _host(template)

    def load(self, meta: AscendVerifyMetadata) -> None:
        """Copy a step's metadata in (same tier, slots and ratios), leaving nothing of the previous step."""
        if _geometry(meta) != self.geometry:
            raise ValueError(f"metadata geometry {_geometry(meta)} does not match the buffers' {self.geometry}")
        for name, src in _tensors(meta).items():
            self.tensors[name].copy_(src)
        self.host = _host(meta)


def _tensors(meta: AscendVerifyMetadata) -> dict[str, Tensor]:
    out = {name: getattr(meta, name) for name in ("cu_seqlens_q", "seq_lens_kv", "start_pos", "seqused",
                                                   "positions", "row_valid")}
    for r, g in meta.compressed.items():
        out.update({f"c{r}_{name}": getattr(g, name) for name in ("positions", "rows", "slots", "valid",
                                                                   "interval_start", "interval_end")})
    return out


def _geometry(meta: AscendVerifyMetadata) -> tuple:
    return (meta.num_tokens, meta.num_slots, meta.max_seqlen_q,
            tuple((r, g.padding_size) for r, g in meta.compressed.items()))


def _host(meta: AscendVerifyMetadata) -> dict[str, list[int]]:
    return {"cu_seqlens_q": list(meta.cu_seqlens_q_host), "actual_seq_lengths_q": list(meta.actual_seq_lengths_q_host),
            "seq_lens_kv": list(meta.seq_lens_kv_host)}


register_graph_backend("npu", NpuGraphBackend)
