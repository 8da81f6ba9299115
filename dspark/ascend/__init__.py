"""Ascend 910C port layer. Imports torch_npu / triton-ascend lazily, only where a device call is made."""
from dspark.ascend import runtime
from dspark.ascend.metadata import AscendVerifyMetadata, CompressedGroups

__all__ = ["AscendVerifyMetadata", "CompressedGroups", "runtime"]
