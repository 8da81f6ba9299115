"""NPU detection and device facts, with torch_npu / triton-ascend imported only when asked.

Importing this module never imports torch_npu. `is_available()` probes it; every other function needs it
and raises `NpuUnavailableError` (naming `pip install dspark[npu]`) when it is missing.
"""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import torch

from dspark.kernels import dispatch

INSTALL_HINT = "install the Ascend extra: pip install dspark[npu] (torch_npu + triton-ascend, with CANN)"


class NpuUnavailableError(RuntimeError):
    """A device call needs torch_npu (or triton-ascend) and it is not importable."""


def torch_npu() -> ModuleType:
    """The torch_npu module (registers `torch.npu`); raises `NpuUnavailableError` when missing."""
    if importlib.util.find_spec("torch_npu") is None:
        raise NpuUnavailableError(f"torch_npu is not installed; {INSTALL_HINT}")
    try:
        return importlib.import_module("torch_npu")
    except (ImportError, OSError) as exc:  # CANN libraries missing or mismatched
        raise NpuUnavailableError(f"torch_npu failed to import ({exc}); {INSTALL_HINT}") from exc


def is_available() -> bool:
    """True when torch_npu imports and reports at least one NPU."""
    try:
        torch_npu()
    except NpuUnavailableError:
        return False
    return bool(torch_npu().npu.is_available())


def _index(device: torch.device | str | int | None) -> int:
    """Device index of an npu device (the current device when unspecified)."""
    npu = torch_npu().npu
    if device is None:
        return int(npu.current_device())
    if isinstance(device, int):
        return device
    dev = torch.device(device) if isinstance(device, str) else device
    if dev.type != "npu":
        raise ValueError(f"expected an npu device, got {dev}")
    return int(dev.index) if dev.index is not None else int(npu.current_device())


def device_name(device: torch.device | str | int | None = None) -> str:
    """Marketing name of the NPU (e.g. `Ascend910_9392`)."""
    return str(torch_npu().npu.get_device_name(_index(device)))


def _properties(index: int) -> dict:
    """The device properties (`dspark.kernels.dispatch.device_properties`, cached there)."""
    try:
        return dispatch.device_properties(index)
    except ImportError as exc:
        raise NpuUnavailableError(f"triton is not importable ({exc}); {INSTALL_HINT}") from exc
    except dispatch.CoreCountError as exc:
        raise NpuUnavailableError(f"{exc}; {INSTALL_HINT}") from exc


def vector_core_count(device: torch.device | str | int | None = None) -> int:
    """Vector cores of the NPU: the grid size of vector-only persistent kernels (cached per device)."""
    return int(_properties(_index(device))[dispatch.CORE_PROPERTY["vector"]])


def ai_core_count(device: torch.device | str | int | None = None) -> int:
    """AI (cube) cores of the NPU: the grid size of persistent kernels that use `tl.dot`."""
    return int(_properties(_index(device))[dispatch.CORE_PROPERTY["dot"]])
