"""Kernel backend choice and launch policy.

CUDA and NPU tensors run Triton kernels (when triton is installed, `dspark.kernels._triton`), CPU tensors
run the torch reference. `DSPARK_KERNEL_BACKEND` (`auto` | `triton` | `torch`) overrides this; tests set
`triton` to run kernels on the CPU through `TRITON_INTERPRET=1`.

Every dspark kernel loops persistently over its work items
(`for item in tl.range(tl.program_id(0), n, tl.num_programs(0))`), so one source serves both launch
policies: `work` (grid = number of items, CUDA) and `cores` (grid = vector-core count, Ascend).
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from dspark.kernels import _triton

BACKEND_ENV = "DSPARK_KERNEL_BACKEND"
_BACKENDS = ("auto", "triton", "torch")
MAX_GRID = 65535  # Ascend coreDim limit (UINT16_MAX); CUDA's grid-x limit is far above it

_policy: tuple[str, int | None] | None = None


def backend() -> str:
    """The configured backend: `auto`, `triton` or `torch`."""
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in _BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not one of {', '.join(_BACKENDS)}")
    return value


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the kernels should run as Triton for these tensors. Without triton installed `auto`
    runs the torch reference everywhere, and forcing `triton` is an error that says what to install."""
    choice = backend()
    if choice == "triton" and not _triton.available():
        raise RuntimeError(f"{BACKEND_ENV}=triton but triton is not installed: {_triton.INSTALL_HINT}")
    if choice != "auto":
        return choice == "triton"
    return _triton.available() and any(t.device.type in ("cuda", "npu") for t in tensors)


def use_host(*tensors: torch.Tensor) -> bool:
    """True when a small-tensor numpy host path serves: CPU tensors under the `auto` backend (a chain of
    torch ops on a few hundred elements costs microseconds per op; numpy, a fraction of that)."""
    return backend() == "auto" and all(t.device.type == "cpu" for t in tensors)


def _device_policy(device: torch.device) -> tuple[str, int | None]:
    if device.type == "npu":
        from dspark.ascend import runtime

        return "cores", runtime.vector_core_count(device)
    return "work", None


@contextlib.contextmanager
def launch_policy(policy: str, num_cores: int | None = None) -> Iterator[None]:
    """Force a launch policy (`work`, or `cores` with a core count) inside the block; used by tests."""
    global _policy
    if policy not in ("work", "cores"):
        raise ValueError(f"launch policy must be 'work' or 'cores', got {policy!r}")
    if policy == "cores" and (not isinstance(num_cores, int) or num_cores < 1):
        raise ValueError(f"the 'cores' policy needs num_cores >= 1, got {num_cores!r}")
    previous, _policy = _policy, (policy, num_cores)
    try:
        yield
    finally:
        _policy = previous


def grid(num_items: int, device: torch.device) -> tuple[int]:
    """1-D grid for `num_items` persistent work items under the active launch policy (never 0)."""
    policy, cores = _policy if _policy is not None else _device_policy(device)
    size = num_items if policy == "work" else min(num_items, cores)
    return (max(1, min(size, MAX_GRID)),)
