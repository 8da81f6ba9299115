"""Ascend 910C port layer. Imports torch_npu / triton-ascend lazily, only where a device call is made."""
