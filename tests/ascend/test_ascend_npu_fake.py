"""Ascend runtime, NPU graph backend and capability decision, on the CPU with a fake torch_npu.

The fake records every call, so the tests check call order (task groups at capture, update windows
before replay, no host sync in replay) without an NPU.
"""
from __future__ import annotations

import importlib.machinery
import subprocess
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.ascend import runtime
from dspark.ascend.capability import (
    CapabilityStatus,
    NpuVerifyConfig,
    RaggedGraphCapability,
    choose_npu_verify_mode,
)
from dspark.ascend.graphs import NpuGraphBackend, VerifyMetadataBuffers
from dspark.ascend.metadata import AscendVerifyMetadata
from dspark.config import VerifyMode
from dspark.kernels import dispatch
from dspark.verify.layout import RaggedVerifyLayout


def _fake_torch_npu(calls: list) -> types.ModuleType:
    def rec(name, ret=None):
        def f(*args, **kwargs):
            calls.append(name)
            return ret
        return f

    class Graph:
        def replay(self):
            calls.append("replay")

    class GraphContext:
        def __init__(self, graph, pool=None):
            calls.append(("capture", pool))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            calls.append("capture_end")

    class Event:
        wait, reset, record = rec("event_wait"), rec("event_reset"), rec("event_record")

    class StreamContext:
        def __init__(self, stream):
            calls.append("stream_enter")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            calls.append("stream_exit")

    npu = types.SimpleNamespace(
        is_available=lambda: True, current_device=lambda: 1, get_device_name=lambda i: f"Ascend910_{i}",
        graph_pool_handle=rec("pool", ret="POOL"), NPUGraph=Graph, graph=GraphContext,
        current_stream=rec("current_stream", ret="S0"), ExternalEvent=Event, Stream=rec("new_stream", ret="S1"),
        stream=StreamContext, graph_task_group_begin=rec("group_begin"),
        graph_task_group_end=rec("group_end", ret="H"), graph_task_update_begin=rec("update_begin"),
        graph_task_update_end=rec("update_end"), synchronize=rec("synchronize"),
    )
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    mod.npu = npu
    return mod


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls))
    import triton.runtime

    props = {0: {"num_vectorcore": 48, "num_aicore": 24}, 1: {"num_vectorcore": 40, "num_aicore": 20}}
    utils = types.SimpleNamespace(get_device_properties=lambda i: props[i])
    monkeypatch.setattr(triton.runtime, "driver", types.SimpleNamespace(active=types.SimpleNamespace(utils=utils)))
    dispatch.device_properties.cache_clear()
    yield calls
    dispatch.device_properties.cache_clear()


def test_import_without_torch_npu() -> None:
    code = ("import sys; sys.modules['torch_npu'] = None\n"
            "import dspark, dspark.ascend\n"
            "from dspark.ascend import runtime, graphs, capability\n"
            "assert not runtime.is_available()\n"
            "try:\n    runtime.vector_core_count(0)\nexcept runtime.NpuUnavailableError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install dspark[npu]" in out.stdout


def test_device_calls_without_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert not runtime.is_available()
    for call in (runtime.device_name, runtime.vector_core_count, runtime.ai_core_count,
                 NpuGraphBackend().new_pool, NpuGraphBackend().synchronize):
        with pytest.raises(runtime.NpuUnavailableError, match=r"pip install dspark\[npu\]"):
            call()


def test_runtime_with_fake(fake_npu: list) -> None:
    assert runtime.is_available()
    assert runtime.device_name() == "Ascend910_1"
    assert runtime.vector_core_count() == 40 and runtime.ai_core_count(0) == 24
    assert runtime.vector_core_count(types.SimpleNamespace(type="npu", index=0)) == 48
    with pytest.raises(ValueError, match="expected an npu device"):
        runtime.vector_core_count(torch.device("cpu"))


def test_dispatch_uses_the_kernels_core_count_on_npu(fake_npu: list) -> None:
    """Vector kernels launch on the vector cores (48 / 40), `dot` kernels on the AI cores (24 / 20),
    read from the driver's device properties; the current device when the index is unset."""
    from dspark.kernels import layout, ragged_attention

    npu0, npu1 = (types.SimpleNamespace(type="npu", index=i) for i in (0, 1))
    vector, dot = layout._pack_kernel, ragged_attention._ragged_attention_kernel
    assert (vector.launch_kind, dot.launch_kind) == ("vector", "dot")
    assert dispatch.grid(10, npu0, vector) == (10,) and dispatch.grid(10, npu0, dot) == (10,)
    assert dispatch.grid(1000, npu0, vector) == (48,) and dispatch.grid(1000, npu0, dot) == (24,)
    assert dispatch.grid(1000, npu1, vector) == (40,) and dispatch.grid(1000, npu1, dot) == (20,)
    current = types.SimpleNamespace(type="npu", index=None)
    assert dispatch.grid(1000, current, dot) == (20,)   # the fake's current device is 1
    assert dispatch.grid(1000, torch.device("cpu"), dot) == (1000,)


def test_missing_core_counts_name_triton_ascend(fake_npu: list, monkeypatch: pytest.MonkeyPatch) -> None:
    import triton.runtime

    utils = types.SimpleNamespace(get_device_properties=lambda i: {"multiprocessor_count": 132})
    monkeypatch.setattr(triton.runtime, "driver", types.SimpleNamespace(active=types.SimpleNamespace(utils=utils)))
    with pytest.raises(runtime.NpuUnavailableError, match="triton-ascend"):
        runtime.vector_core_count(0)


def test_capture_and_replay_order(fake_npu: list) -> None:
    backend = NpuGraphBackend(warmup=1)
    host = {"lens": [1]}
    seen: list = []

    def attention() -> None:
        fake_npu.append("attention")
        seen.append(list(host["lens"]))

    def step() -> None:
        fake_npu.append("matmul")
        backend.updatable(attention)

    graph = backend.capture(step, backend.new_pool())
    assert fake_npu == ["pool", "matmul", "attention",                       # warm-up: plain calls
                        ("capture", "POOL"), "matmul", "current_stream", "event_wait", "event_reset",
                        "group_begin", "attention", "group_end", "capture_end"]
    assert len(graph.task_groups) == 1 and graph.task_groups[0].handle == "H"
    fake_npu.clear()

    def update() -> None:
        fake_npu.append("update")
        host["lens"] = [2, 3, 7]

    backend.replay(graph, update)
    assert fake_npu == ["update", "new_stream", "stream_enter", "update_begin", "attention", "update_end",
                        "event_record", "stream_exit", "replay"]
    assert seen[-1] == [2, 3, 7]          # the re-issued op read the refreshed host lists
    fake_npu.clear()
    backend.replay(graph)                 # the update stream is reused; no host sync anywhere
    assert "synchronize" not in fake_npu and "new_stream" not in fake_npu and fake_npu[-1] == "replay"


def test_replay_without_task_groups(fake_npu: list) -> None:
    backend = NpuGraphBackend(warmup=0)
    graph = backend.capture(lambda: fake_npu.append("op"), None)
    fake_npu.clear()
    backend.replay(graph, lambda: fake_npu.append("update"))
    assert fake_npu == ["update", "replay"]
    with pytest.raises(TypeError, match="NpuGraphBackend.capture"):
        backend.replay(object())
    with pytest.raises(ValueError, match="warmup"):
        NpuGraphBackend(warmup=-1)


def _graph_meta(lens: list[int], live: list[int]) -> AscendVerifyMetadata:
    layout = RaggedVerifyLayout.from_verify_lens(lens, tiers=[8], graph_slots=4, width=4)
    return AscendVerifyMetadata.from_layout(layout, live)


def test_buffers_leave_nothing_stale() -> None:
    """Two layouts of one tier in a row ([4,4] then [1,1]): the buffers equal fresh metadata of the second."""
    first, second = _graph_meta([4, 4], [3, 126]), _graph_meta([1, 1], [7, 9])
    bufs = VerifyMetadataBuffers(first)
    bufs.load(second)
    fresh = VerifyMetadataBuffers(second)
    assert bufs.host == fresh.host and bufs.host["actual_seq_lengths_q"] == [1, 2, 6, 8]
    for name, t in fresh.tensors.items():
        assert torch.equal(bufs.tensors[name], t), name
    with pytest.raises(ValueError, match="geometry"):
        bufs.load(AscendVerifyMetadata.from_layout(RaggedVerifyLayout.from_verify_lens([1, 1]), [7, 9]))


@st.composite
def _tier8_step(draw):
    b = draw(st.integers(0, 2))   # <= 8 rows: always tier 8, padding fits the ghost slots
    lens = draw(st.lists(st.integers(1, 4), min_size=b, max_size=b))
    return lens, draw(st.lists(st.integers(0, 300), min_size=b, max_size=b))


@settings(max_examples=15)
@given(st.lists(_tier8_step(), min_size=2, max_size=4))
def test_buffers_equal_the_last_step_after_any_sequence(steps) -> None:
    metas = [_graph_meta(lens, live) for lens, live in steps]
    bufs = VerifyMetadataBuffers(metas[0])
    for m in metas[1:]:
        bufs.load(m)
    fresh = VerifyMetadataBuffers(metas[-1])
    assert bufs.host == fresh.host
    assert all(torch.equal(bufs.tensors[k], t) for k, t in fresh.tensors.items())


CFG = NpuVerifyConfig(tiers=(8, 16), slots=(4, 8), width=4)


def test_capability_and_mode_choice(caplog: pytest.LogCaptureFixture) -> None:
    cap = RaggedGraphCapability()
    backend = NpuGraphBackend(capability=cap)
    assert not backend.supports_ragged_verify_graph(CFG)
    mode, reason = choose_npu_verify_mode("compact", cap.status(CFG))
    assert mode is VerifyMode.STATIC and "no equivalence checks recorded" in reason
    assert "falls back to static" in caplog.text
    cap.record(CFG, eager_passed=True, graph_passed=False, detail="stale q_pa at row 3")
    assert not backend.supports_ragged_verify_graph(CFG)
    mode, reason = choose_npu_verify_mode(VerifyMode.COMPACT, cap.status(CFG))
    assert mode is VerifyMode.STATIC and "graph replay == eager failed" in reason and "stale q_pa" in reason
    cap.record(CFG, eager_passed=True, graph_passed=True)
    assert backend.supports_ragged_verify_graph(CFG)
    assert choose_npu_verify_mode("compact", cap.status(CFG))[0] is VerifyMode.COMPACT
    other = NpuVerifyConfig(tiers=(8,), slots=(4,), width=4)
    assert not cap.supports_ragged_verify_graph(other)
    for requested in ("static", "cap-accept"):
        assert choose_npu_verify_mode(requested, CapabilityStatus(False, "x"))[0] is VerifyMode.parse(requested)
    with pytest.raises(ValueError, match="unknown verify mode"):
        choose_npu_verify_mode("ragged", cap.status(CFG))
    with pytest.raises(TypeError, match="CapabilityStatus"):
        choose_npu_verify_mode("compact", True)
    with pytest.raises(TypeError, match="NpuVerifyConfig"):
        cap.record((8,), eager_passed=True, graph_passed=True)


def test_npu_launch_policy_uses_each_kinds_cores(fake_npu: list) -> None:
    from dspark.ascend.launch import npu_launch_policy
    from dspark.kernels import layout, ragged_attention

    with npu_launch_policy(0) as cores:
        assert cores == {"vector": 48, "dot": 24}
        assert dispatch.grid(1000, torch.device("cpu"), layout._pack_kernel) == (48,)
        assert dispatch.grid(1000, torch.device("cpu"), ragged_attention._ragged_attention_kernel) == (24,)
    assert dispatch.grid(1000, torch.device("cpu"), layout._pack_kernel) == (1000,)


def test_tier_graph_runner_drives_the_npu_backend(fake_npu: list) -> None:
    """The tiers runner with the NPU backend: one pool, one capture per tier, replay after the update,
    and updatable ops re-issued with the host lists of the step's metadata."""
    graphs = pytest.importorskip("dspark.verify.graphs")
    backend = graphs.default_backend(types.SimpleNamespace(type="npu", index=0))
    assert isinstance(backend, NpuGraphBackend)
    host_bufs = {t: VerifyMetadataBuffers(_graph_meta([1], [0]) if t == 8 else
                                          AscendVerifyMetadata.from_layout(
                                              RaggedVerifyLayout.from_verify_lens([1], tiers=[4], graph_slots=4, width=4), [0]))
                 for t in (4, 8)}
    seen: list = []

    def step(bufs):
        tier = bufs.num_tokens
        backend.updatable(lambda: seen.append(host_bufs[tier].host["actual_seq_lengths_q"]))
        return bufs.rows["x"] * 2

    runner = graphs.TierGraphRunner(step, graphs.TierSpec([4, 8], slots=4, width=4), device="cpu", backend=backend,
                                    row_inputs={"x": ((), torch.float32)})
    runner.capture()
    assert fake_npu.count("pool") == 1 and [c for c in fake_npu if isinstance(c, tuple)] == [("capture", "POOL")] * 2
    fake_npu.clear()
    layout = runner.layout([2, 1, 4])
    host_bufs[8].load(AscendVerifyMetadata.from_layout(layout, [10, 127, 255]))
    runner.run(layout, x=torch.arange(7, dtype=torch.float32))
    assert runner.replays[8] == 1 and fake_npu[-1] == "replay" and "synchronize" not in fake_npu
    assert seen[-1] == [2, 3, 7, 8]
    assert torch.equal(runner._buffers[8].slot_lens, layout.slot_lens)   # the runner's update ran


def test_capability_round_trips_through_json(tmp_path) -> None:
    cap = RaggedGraphCapability()
    cap.record(CFG, eager_passed=True, graph_passed=True)
    other = NpuVerifyConfig(tiers=(8,), slots=(4,), width=4, device_name="Ascend910_9392")
    cap.record(other, eager_passed=True, graph_passed=False, detail="replay != eager")
    loaded = RaggedGraphCapability.load(cap.save(tmp_path / "cap.json"))
    assert loaded.records == cap.records
    assert loaded.supports_ragged_verify_graph(CFG) and not loaded.supports_ragged_verify_graph(other)
    with pytest.raises(ValueError, match="not a dspark.npu_ragged_verify_capability"):
        RaggedGraphCapability.from_json({"schema": "other"})
    with pytest.raises(ValueError, match="bad capability record"):
        RaggedGraphCapability.from_json({"schema": "dspark.npu_ragged_verify_capability", "version": 1,
                                         "records": [{"config": {"tiers": [8]}}]})
