"""Device checks on a real Ascend NPU (`pytest --device npu`); skipped elsewhere."""
from __future__ import annotations

import pytest
import torch

from dspark.ascend import (
    AscendVerifyMetadata,
    NpuGraphBackend,
    VerifyMetadataBuffers,
    runtime,
)
from dspark.ascend.launch import npu_launch_policy
from dspark.kernels import dispatch
from dspark.verify.layout import RaggedVerifyLayout

pytestmark = pytest.mark.npu


def test_runtime_reports_the_device(device) -> None:
    assert runtime.is_available() and runtime.device_name(device)
    assert runtime.vector_core_count(device) >= runtime.ai_core_count(device) >= 1
    from dspark.kernels import layout, ragged_attention

    with npu_launch_policy(device) as cores:
        assert cores == {"vector": runtime.vector_core_count(device), "dot": runtime.ai_core_count(device)}
        assert dispatch.grid(10**6, device, layout._pack_kernel) == (min(cores["vector"], dispatch.MAX_GRID),)
        assert dispatch.grid(10**6, device, ragged_attention._ragged_attention_kernel) == (cores["dot"],)
    assert dispatch.grid(10**6, device, ragged_attention._ragged_attention_kernel) == (cores["dot"],)


def test_metadata_on_the_npu_equals_the_cpu(device) -> None:
    for lens, live, kw in (([2, 1, 4], [10, 127, 255], {}), ([2, 1, 4], [10, 127, 255], {"tiers": [8], "slots": 8})):
        cpu = AscendVerifyMetadata.from_layout(RaggedVerifyLayout.from_verify_lens(lens, width=4, **kw), live)
        lay = RaggedVerifyLayout.from_verify_lens(torch.tensor(lens, dtype=torch.int32, device=device), width=4, **kw)
        assert AscendVerifyMetadata.from_layout(lay, torch.tensor(live, device=device)).diff(cpu) == []


def test_graph_replay_sees_each_layout(device) -> None:
    def meta(lens, live):
        lay = RaggedVerifyLayout.from_verify_lens(torch.tensor(lens, dtype=torch.int32, device=device),
                                                  tiers=[8], graph_slots=4, width=4)
        return AscendVerifyMetadata.from_layout(lay, torch.tensor(live, device=device))

    table = torch.arange(512, dtype=torch.float32, device=device) + 0.5
    bufs = VerifyMetadataBuffers(meta([4, 4], [3, 126]))
    out = {}
    backend = NpuGraphBackend(device)

    def step() -> None:
        out["rows"] = table.index_select(0, bufs.tensors["positions"]) * bufs.tensors["row_valid"]

    graph = backend.capture(step, backend.new_pool())
    for lens, live in (([4, 4], [3, 126]), ([1, 1], [7, 9]), ([2, 1, 4], [10, 127, 255])):
        m = meta(lens, live)
        backend.replay(graph, lambda m=m: bufs.load(m))
        backend.synchronize()
        assert torch.equal(out["rows"], table.index_select(0, m.positions) * m.row_valid)
