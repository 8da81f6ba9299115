"""Kernel backend choice and launch policy.

CUDA and NPU tensors run Triton kernels (when triton is installed, `dspark.kernels._triton`), CPU tensors
run the torch reference. `DSPARK_KERNEL_BACKEND` (`auto` | `triton` | `torch`) overrides this; tests set
`triton` to run kernels on the CPU through `TRITON_INTERPRET=1`. Inside `torch.compile` the public verify
path takes its torch references (`use_kernel`, `use_host`), so a traced step has no numpy call or launcher.

Every dspark kernel loops persistently over its work items
(`for item in tl.range(tl.program_id(0), n, tl.num_programs(0))`), so one source serves both launch
policies: `work` (grid = number of items, CUDA) and `cores` (grid = a core count, Ascend). Each launched
kernel declares its kind next to its definition (`@kernel_kind("dot")` above `@jit`): `dot` kernels
(`tl.dot`, the cube units) launch on the AI-core count, `vector` kernels on the vector-core count, both
read from the active Triton driver's device properties (`num_aicore`, `num_vectorcore`, triton-ascend).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
from typing import Any, Callable, Iterator, Mapping

import torch

from dspark.kernels import _triton
from dspark.kernels.compare import FP32_EXACT

BACKEND_ENV = "DSPARK_KERNEL_BACKEND"
_BACKENDS = ("auto", "triton", "torch")
MAX_GRID = 65535  # Ascend coreDim limit (UINT16_MAX); CUDA's grid-x limit is far above it
KINDS = ("vector", "dot")
CORE_PROPERTY = {"vector": "num_vectorcore", "dot": "num_aicore"}  # triton-ascend's device-property names

_policy: tuple[str, dict[str, int] | None] | None = None


class CoreCountError(RuntimeError):
    """The active Triton driver reports no core counts (community triton instead of triton-ascend)."""


def kernel_kind(kind: str) -> Callable[[Any], Any]:
    """Declare a launched kernel's kind: `vector` (vector units only) or `dot` (uses `tl.dot`)."""
    if kind not in KINDS:
        raise ValueError(f"kernel kind must be one of {KINDS}, got {kind!r}")

    def declare(kernel: Any) -> Any:
        kernel.launch_kind = kind
        return kernel
    return declare


def backend() -> str:
    """The configured backend: `auto`, `triton` or `torch`."""
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in _BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not one of {', '.join(_BACKENDS)}")
    return value


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the kernels should run as Triton for these tensors. Without triton installed `auto`
    runs the torch reference everywhere, and forcing `triton` is an error that says what to install.
    Forced `triton` runs CPU tensors only under the interpreter (`TRITON_INTERPRET=1`); without it a
    compiled Triton kernel cannot read host memory, so they take the torch reference."""
    choice = backend()
    if choice == "triton" and not _triton.available():
        raise RuntimeError(f"{BACKEND_ENV}=triton but triton is not installed: {_triton.INSTALL_HINT}")
    on_accelerator = any(t.device.type in ("cuda", "npu") for t in tensors)
    if choice != "auto":
        return choice == "triton" and (on_accelerator or os.environ.get("TRITON_INTERPRET") == "1")
    return _triton.available() and on_accelerator


def tracing() -> bool:
    """True inside `torch.compile`: the traced path (torch ops only, static shapes, no host read, so no data
    check that reads a tensor's values)."""
    return torch.compiler.is_compiling()


def use_host(*tensors: torch.Tensor) -> bool:
    """True when a small-tensor numpy host path serves: CPU tensors that need no autograd, under the `auto`
    backend, outside `torch.compile` (a chain of torch ops on a few hundred elements costs microseconds per
    op; numpy, a fraction of that; a traced function takes the torch path, numpy does not trace)."""
    if tracing():
        return False
    return backend() == "auto" and all(t.device.type == "cpu" and not t.requires_grad for t in tensors)


def use_kernel(*tensors: torch.Tensor) -> bool:
    """`use_triton`, except inside `torch.compile`: a traced public function runs the torch reference (the
    kernels' launchers read host integers)."""
    return not tracing() and use_triton(*tensors)


@functools.lru_cache(maxsize=None)
def device_properties(index: int) -> dict:
    """The active Triton driver's properties of device `index`; they must name both core counts."""
    driver = importlib.import_module("triton.runtime").driver
    props = dict(driver.active.utils.get_device_properties(index))
    missing = [CORE_PROPERTY[k] for k in KINDS if CORE_PROPERTY[k] not in props]
    if missing:
        raise CoreCountError(f"the active Triton driver reports no {missing} for device {index} (is community "
                             "triton installed instead of triton-ascend?)")
    return props


def core_count(device: Any, kind: str) -> int:
    """Cores a persistent `kind` kernel launches on: AI cores for `dot`, vector cores for `vector`."""
    if kind not in KINDS:
        raise ValueError(f"kernel kind must be one of {KINDS}, got {kind!r}")
    index = device.index if device.index is not None else importlib.import_module("torch_npu").npu.current_device()
    return int(device_properties(int(index))[CORE_PROPERTY[kind]])


def _kind(kernel: Any) -> str:
    kind = getattr(kernel, "launch_kind", None)
    if kind not in KINDS:
        name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", repr(kernel))
        raise ValueError(f"kernel {name} declares no launch kind; put @dispatch.kernel_kind('vector' or 'dot') "
                         "above its @jit")
    return kind


@contextlib.contextmanager
def launch_policy(policy: str, num_cores: int | Mapping[str, int] | None = None) -> Iterator[None]:
    """Force a launch policy inside the block (tests, `ascend.launch.npu_launch_policy`): `work`, or `cores`
    with one core count for every kind or a count per kind ({"vector": .., "dot": ..})."""
    global _policy
    if policy not in ("work", "cores"):
        raise ValueError(f"launch policy must be 'work' or 'cores', got {policy!r}")
    counts = None
    if policy == "cores":
        counts = dict.fromkeys(KINDS, num_cores) if not isinstance(num_cores, Mapping) else dict(num_cores)
        bad = {k: v for k, v in counts.items() if k not in KINDS or isinstance(v, bool) or not isinstance(v, int)
               or v < 1}
        if bad or set(counts) != set(KINDS):
            raise ValueError(f"the 'cores' policy needs num_cores >= 1 for each kind {KINDS}, got {num_cores!r}")
    previous, _policy = _policy, (policy, counts)
    try:
        yield
    finally:
        _policy = previous


def _active(device: Any) -> tuple[str, dict[str, int] | None]:
    if _policy is not None:
        return _policy
    return ("cores", None) if device.type == "npu" else ("work", None)


def fp32_compares(device: Any, bound: int) -> bool:
    """True when the kernels compare in exact fp32 (`dspark.kernels.compare`): an Ascend-shaped launch (the
    `cores` policy: an NPU device, or forced) whose compared integers all stay below `bound` < 2**24."""
    return _active(device)[0] == "cores" and bound < FP32_EXACT


def grid(num_items: int, device: torch.device, kernel: Any) -> tuple[int]:
    """1-D grid for `num_items` persistent work items of `kernel` under the active launch policy (never 0):
    the items on CUDA / CPU, at most the cores of the kernel's kind on an NPU."""
    kind = _kind(kernel)
    policy, counts = _active(device)
    if policy == "work":
        size = num_items
    else:
        size = min(num_items, counts[kind] if counts is not None else core_count(device, kind))
    return (max(1, min(size, MAX_GRID)),)
