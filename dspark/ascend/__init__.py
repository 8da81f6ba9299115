"""Ascend 910C port layer. Imports torch_npu / triton-ascend lazily, only where a device call is made.

- `runtime`: NPU detection, device name, vector/AI core counts.
- `AscendVerifyMetadata`: ragged TARGET_VERIFY metadata (and the static path's values) from a layout.
- `NpuGraphBackend`, `VerifyMetadataBuffers`: NPU graph tiers with host-parameter refresh.
- `launch`: the grid = vector-cores launch policy and the kernel-source checker.
- `RaggedGraphCapability`, `choose_npu_verify_mode`: compact only for verified configurations.
- `NpuVerifyAttention`, `use_npu_attention`: the NPU attention backend (torch_npu's fused infer attention over
  the ragged layout); `emulator`: that operator emulated on the CPU (tests, the CPU bring-up ladder);
  `compressor`: the reference C4 / C128 compressor.
"""
from dspark.ascend import launch, runtime
from dspark.ascend.attention import NpuVerifyAttention, npu_attention, use_npu_attention
from dspark.ascend.capability import (
    CapabilityStatus,
    NpuVerifyConfig,
    RaggedGraphCapability,
    choose_npu_verify_mode,
)
from dspark.ascend.graphs import NpuGraphBackend, VerifyMetadataBuffers
from dspark.ascend.metadata import AscendVerifyMetadata, CompressedGroups

__all__ = [
    "AscendVerifyMetadata",
    "CapabilityStatus",
    "CompressedGroups",
    "NpuGraphBackend",
    "NpuVerifyAttention",
    "NpuVerifyConfig",
    "RaggedGraphCapability",
    "VerifyMetadataBuffers",
    "choose_npu_verify_mode",
    "launch",
    "npu_attention",
    "runtime",
    "use_npu_attention",
]
