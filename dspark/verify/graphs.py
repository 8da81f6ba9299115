"""TierGraphRunner: one captured graph per token tier, replayed with the live layout padded to the tier.

A compact verify step has a data-dependent row count; a captured graph has a static one. The runner
captures one graph per token tier (largest first, all in one memory pool) over static buffers, and a
step replays the smallest tier that holds its rows: the live layout and row inputs are copied into the
tier's buffers, padding rows go to ghost slots (`seqused = 0`, so a well-formed step never writes the
KV cache for them). Past the largest tier, or with more requests than the tier's captured slots, the
step runs eager with a logged reason. Backends (CUDA graphs, NPU graphs, eager CPU) sit behind the small
`GraphBackend` protocol; the CPU backend runs eagerly at the padded tier shape so that CPU timings show
the same staircase as graph replay.

Tier manifests (`TierManifest`) record what was captured and live as JSON under `graphs/`.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence, Union

import torch
from torch import Tensor

from dspark.util.validate import check_type, int_tensor
from dspark.verify import boundary
from dspark.verify.layout import RaggedVerifyLayout, check_tiers, round_up_to_tier
from dspark.verify.manifest import TierManifest, check_capture

log = logging.getLogger(__name__)


StepOutput = Union[Tensor, dict[str, Tensor]]
RowSpec = tuple[tuple[int, ...], torch.dtype]


class GraphBackend(Protocol):
    """What the runner needs from a graph platform (CUDA graphs, NPU graphs, or eager).

    static_outputs: True when a replay writes the step's outputs into the tensors its capture returned (graphs:
    the runner keeps every tier's outputs; such a backend's `capture` must run `fn`), False when each replay
    returns fresh tensors (eager: the runner keeps none once a step has returned, so idle tiers hold no memory;
    its `capture` may run nothing)."""

    name: str
    static_outputs: bool

    def new_pool(self) -> object:
        """A memory pool handle shared by every tier's graph (may be None)."""
        ...

    def capture(self, fn: Callable[[], None], pool: object) -> object:
        """Capture `fn` (which reads and writes only static buffers; run here when `static_outputs`); return a
        graph handle."""
        ...

    def replay(self, graph: object, update: Callable[[], None] | None = None) -> None:
        """Replay a captured graph; `update` refreshes buffers / host-visible metadata first."""
        ...

    def synchronize(self) -> None:
        """Wait for the device."""
        ...


class EagerBackend:
    """CPU (or any device) backend: nothing is captured (the capture runs no step); 'replay' runs the step
    eagerly at the padded tier shape."""

    name = "eager"
    static_outputs = False

    def new_pool(self) -> object:
        return None

    def capture(self, fn: Callable[[], None], pool: object) -> object:
        return fn

    def replay(self, graph: object, update: Callable[[], None] | None = None) -> None:
        if update is not None:
            update()
        graph()

    def synchronize(self) -> None:
        return None


class CudaGraphBackend:
    """`torch.cuda.CUDAGraph` capture with warm-up on a side stream and one shared pool."""

    name = "cuda"
    static_outputs = True

    def __init__(self, device: torch.device, warmup: int = 2) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaGraphBackend needs a cuda device, got {device}")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (lazy kernel init must not be captured), got {warmup}")
        self.device = device
        self.warmup = warmup

    def new_pool(self) -> object:
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], None], pool: object) -> object:
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                fn()
        return graph

    def replay(self, graph: object, update: Callable[[], None] | None = None) -> None:
        if update is not None:
            update()
        graph.replay()  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


GRAPH_BACKENDS: dict[str, Callable[[torch.device], GraphBackend]] = {"cuda": CudaGraphBackend}


def register_graph_backend(device_type: str, factory: Callable[[torch.device], GraphBackend]) -> None:
    """Make `factory(device)` the graph backend of `device_type` devices (`dspark.ascend` registers `npu`)."""
    GRAPH_BACKENDS[device_type] = factory


def default_backend(device: torch.device) -> GraphBackend:
    """The registered graph backend of the device's type (CUDA graphs on cuda), eager on the CPU."""
    if device.type == "cpu":
        return EagerBackend()
    if device.type not in GRAPH_BACKENDS:
        raise ValueError(f"no graph backend is registered for device type {device.type!r}: import dspark.ascend "
                         f"for npu, register one (register_graph_backend), or pass backend=")
    return GRAPH_BACKENDS[device.type](device)


@dataclass(frozen=True)
class StepBuffers:
    """What a step function sees: per-row inputs and the layout metadata, all of static shape per tier.

    Rows `>= the real total` are padding rows of ghost slots; `row_valid` marks the real ones, computed
    on the device (graph-safe, no host sync).
    """

    rows: dict[str, Tensor]   # name -> [num_tokens, ...] per-row inputs (padding rows zeroed)
    slot_lens: Tensor         # [S] int32
    seqused: Tensor           # [S] int32, 0 for ghost slots
    slot_qo_indptr: Tensor    # [S+1] int32
    row_slot: Tensor          # [num_tokens] int32
    row_within: Tensor        # [num_tokens] int32

    @property
    def num_tokens(self) -> int:
        return int(self.row_slot.numel())

    @property
    def row_valid(self) -> Tensor:
        """[num_tokens] bool: the row is a real verify row (its slot uses it)."""
        return self.row_within < self.seqused.index_select(0, self.row_slot.to(torch.int64))



@dataclass(frozen=True)
class TierSpec:
    """What a `TierGraphRunner` captures, checked when built: `tiers` strictly increasing token counts (at least
    one); `slots` the slot count S of each, ghost slots included (one int for every tier, or one per tier; a padded
    step of B requests needs B + ceil(padding / W) <= S, so `max_requests + ceil(tier / W)` always suffices);
    `width` W, the most rows per request. Tiers and slots are kept as tuples, one slot count per tier."""

    tiers: Sequence[int]
    slots: int | Sequence[int]
    width: int

    def __post_init__(self) -> None:
        tiers = check_tiers(self.tiers)
        slots = (self.slots,) * len(tiers) if isinstance(self.slots, int) else self.slots
        tiers, slots = check_capture(tiers, slots, self.width)
        object.__setattr__(self, "tiers", tiers)
        object.__setattr__(self, "slots", slots)


class TierGraphRunner:
    """Capture `step_fn` once per token tier and replay the smallest tier that holds a step's rows.

    step_fn(StepBuffers) -> Tensor | dict[str, Tensor] (row-major outputs `[num_tokens, ...]`). It must
    be capturable: static shapes, no host sync, no writes for rows where `row_valid` is False.
    spec: the tiers, their slot counts and W (`TierSpec`).
    row_inputs: name -> (trailing shape, dtype) of every per-row input the step reads.
    prepare(layout): host work the step needs for each layout it runs (the attention's `plan`), called
    with the tier's idle layout before its capture and with the live layout before every replay (inside
    the backend's `update`) or eager run, so that `step_fn` itself does no host work.
    """

    def __init__(
        self,
        step_fn: Callable[[StepBuffers], StepOutput],
        spec: TierSpec,
        device: torch.device | str,
        backend: GraphBackend | None = None,
        *,
        row_inputs: Mapping[str, RowSpec],
        model_id: str = "",
        prepare: Callable[[RaggedVerifyLayout], None] | None = None,
    ) -> None:
        check_type("spec", spec, TierSpec)
        device = torch.device(device)
        self.manifest = TierManifest(tiers=spec.tiers, slots=spec.slots, width=spec.width, platform=device.type,
                                     model_id=model_id, device_name=_device_name(device))
        for name, row in row_inputs.items():
            if (not isinstance(row, tuple) or len(row) != 2 or not isinstance(row[1], torch.dtype)
                    or not all(isinstance(d, int) and d >= 0 for d in row[0])):
                raise TypeError(f"row_inputs[{name!r}] must be ((dims...), torch.dtype), got {row!r}")
        self.step_fn = step_fn
        self.prepare = prepare
        self.device = device
        self.backend = backend if backend is not None else default_backend(device)
        self.row_inputs = dict(row_inputs)
        self.spec = spec
        self.tiers = spec.tiers
        self.width = spec.width
        self._graphs: dict[int, object] = {}
        self._buffers: dict[int, StepBuffers] = {}
        self._outputs: dict[int, StepOutput] = {}
        self.replays = {t: 0 for t in spec.tiers}
        self.eager_steps = 0

    @classmethod
    def from_manifest(cls, step_fn: Callable[[StepBuffers], StepOutput], manifest: TierManifest,
                      device: torch.device | str, backend: GraphBackend | None = None, *,
                      row_inputs: Mapping[str, RowSpec],
                      prepare: Callable[[RaggedVerifyLayout], None] | None = None) -> "TierGraphRunner":
        """A runner for the tiers and slot counts a manifest records (same width and model id)."""
        return cls(step_fn, TierSpec(manifest.tiers, manifest.slots, manifest.width), device, backend,
                   row_inputs=row_inputs, model_id=manifest.model_id, prepare=prepare)

    @property
    def captured(self) -> bool:
        return len(self._graphs) == len(self.tiers)

    def capture(self) -> "TierGraphRunner":
        """Capture every tier, largest first, into one shared pool (idempotent)."""
        if self.captured:
            return self
        top = self.tiers[-1]
        max_slots = max(self.manifest.slots)
        rows = {n: torch.zeros((top, *shape), dtype=dt, device=self.device)
                for n, (shape, dt) in self.row_inputs.items()}
        meta = {k: torch.zeros(n, dtype=torch.int32, device=self.device)
                for k, n in (("slot_lens", max_slots), ("seqused", max_slots),
                             ("slot_qo_indptr", max_slots + 1), ("row_slot", top), ("row_within", top))}
        pool = self.backend.new_pool()
        for tier in reversed(self.tiers):
            s = self.manifest.slots_for(tier)
            bufs = StepBuffers(rows={n: r[:tier] for n, r in rows.items()}, slot_lens=meta["slot_lens"][:s],
                               seqused=meta["seqused"][:s], slot_qo_indptr=meta["slot_qo_indptr"][: s + 1],
                               row_slot=meta["row_slot"][:tier], row_within=meta["row_within"][:tier])
            idle = RaggedVerifyLayout.from_verify_lens(  # built on the host, moved: the plan reads no device
                torch.zeros(0, dtype=torch.int32), tiers=[tier], graph_slots=s, width=self.width).to(self.device)
            _load_layout(bufs, idle)
            self._prepare(idle)
            self._buffers[tier] = bufs
            self._graphs[tier] = self.backend.capture(self._body(tier), pool)
            if not self.backend.static_outputs:
                self._outputs.clear()
        self.backend.synchronize()
        return self

    def _body(self, tier: int) -> Callable[[], None]:
        bufs = self._buffers[tier]

        def body() -> None:
            self._outputs[tier] = self.step_fn(bufs)

        return body

    def layout(self, verify_lens: Tensor | Sequence[int]) -> RaggedVerifyLayout:
        """The layout a step with these verify lengths runs: padded to its tier with that tier's slots,
        or eager (unpadded, `eager_reason` set) past the largest tier or the tier's slot count. The lengths
        are read to the host once (none for a list or a CPU tensor), the layout is built there and moved to
        the runner's device in one copy, keeping the host one (`layout.host`) for the attention's plan."""
        lens = int_tensor("verify_lens", verify_lens, torch.int32)
        if not boundary.on_host(lens):
            lens = torch.from_numpy(boundary.to_host(lens))
        return self._host_layout(lens).to(self.device)

    def _host_layout(self, lens: Tensor) -> RaggedVerifyLayout:
        if lens.dim() == 1:
            total, b = int(lens.sum()), int(lens.numel())
            tier = round_up_to_tier(total, self.tiers)
            if tier is not None:
                s = self.manifest.slots_for(tier)
                ghosts = -(-(tier - total) // self.width)  # ghost slots the padding needs (<= W rows each)
                if b + ghosts > s:
                    reason = (f"{b} requests + {ghosts} ghost slots for {tier - total} padding rows exceed "
                              f"the {s} slots captured for tier {tier}")
                    lay = RaggedVerifyLayout.from_verify_lens(lens, width=self.width)
                    return dataclasses.replace(lay, eager_reason=reason)
                return RaggedVerifyLayout.from_verify_lens(lens, self.tiers, graph_slots=s, width=self.width)
        return RaggedVerifyLayout.from_verify_lens(lens, self.tiers, width=self.width)

    def run(self, layout: RaggedVerifyLayout, **rows: Tensor) -> StepOutput:
        """Run one step: replay the layout's tier (rows copied into its static buffers, padding zeroed)
        or run eager with a logged reason. Returns outputs for the real rows `[total_rows, ...]`; on a
        graph replay (`backend.static_outputs`) they are views of the tier's static outputs, valid until the
        next step of that tier."""
        self._check_rows(layout, rows)
        if layout.tier is None:
            if layout.eager_reason is None:
                raise ValueError(
                    f"layout has no tier and no eager reason (built without tiers); use runner.layout() "
                    f"so the step pads to one of the captured tiers {list(self.tiers)}"
                )
            log.info("eager verify step: %s", layout.eager_reason)
            self.eager_steps += 1
            self._prepare(layout)
            bufs = StepBuffers(rows={n: r[: layout.total_rows] for n, r in rows.items()},
                               slot_lens=layout.slot_lens, seqused=layout.seqused,
                               slot_qo_indptr=layout.slot_qo_indptr, row_slot=layout.row_slot,
                               row_within=layout.row_within)
            return self.step_fn(bufs)
        if layout.tier not in self._graphs:
            raise ValueError(
                f"layout tier {layout.tier} is not a captured tier {list(self.tiers)}"
                + ("" if self.captured else " (call runner.capture() first)")
            )
        bufs = self._buffers[layout.tier]
        if layout.num_slots != bufs.slot_lens.numel():
            raise ValueError(
                f"layout has {layout.num_slots} slots but tier {layout.tier} was captured with "
                f"{bufs.slot_lens.numel()}; build it with runner.layout()"
            )

        def update() -> None:
            self._prepare(layout)
            _load_layout(bufs, layout)
            for name, src in rows.items():
                dst = bufs.rows[name]
                dst[: layout.total_rows].copy_(src[: layout.total_rows])
                dst[layout.total_rows:].zero_()

        self.replays[layout.tier] += 1
        if type(self.backend) is EagerBackend:  # nothing captured: run the step at the tier's padded shape
            update()
            return _slice_rows(self.step_fn(bufs), layout.total_rows)
        self.backend.replay(self._graphs[layout.tier], update)
        out = self._outputs[layout.tier] if self.backend.static_outputs else self._outputs.pop(layout.tier)
        return _slice_rows(out, layout.total_rows)

    def _prepare(self, layout: RaggedVerifyLayout) -> None:
        if self.prepare is not None:
            self.prepare(layout)

    def _check_rows(self, layout: RaggedVerifyLayout, rows: Mapping[str, Tensor]) -> None:
        if set(rows) != set(self.row_inputs):
            raise ValueError(f"row inputs must be exactly {sorted(self.row_inputs)}, got {sorted(rows)}")
        if layout.width != self.width:
            raise ValueError(f"layout width {layout.width} != runner width W={self.width}")
        for name, x in rows.items():
            shape, dtype = self.row_inputs[name]
            if x.dim() != 1 + len(shape) or tuple(x.shape[1:]) != shape or x.shape[0] < layout.total_rows:
                raise ValueError(
                    f"row input {name!r} must be [>= {layout.total_rows}, *{shape}], got {tuple(x.shape)}"
                )
            if x.dtype != dtype:
                raise TypeError(f"row input {name!r} must be {dtype}, got {x.dtype}")

    def synchronize(self) -> None:
        self.backend.synchronize()


def _load_layout(bufs: StepBuffers, layout: RaggedVerifyLayout) -> None:
    bufs.slot_lens.copy_(layout.slot_lens)
    bufs.seqused.copy_(layout.seqused)
    bufs.slot_qo_indptr.copy_(layout.slot_qo_indptr)
    bufs.row_slot.copy_(layout.row_slot)
    bufs.row_within.copy_(layout.row_within)


def _slice_rows(out: StepOutput, n: int) -> StepOutput:
    if isinstance(out, Tensor):
        return out[:n]
    return {k: v[:n] for k, v in out.items()}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type
