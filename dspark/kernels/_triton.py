"""triton, imported when installed: the kernels need it, the CPU paths do not.

`triton` is a Linux/GPU dependency (the `gpu` extra, or triton-ascend from the `npu` extra); without it
`import dspark` and every CPU (torch reference / numpy host) path still work. The kernel modules take
`triton`, `tl`, `jit` and `constexpr` from here: without triton, `jit` keeps a placeholder that names the
missing package if launched, and `dispatch.use_triton` never sends work to it.
"""
from __future__ import annotations

from typing import Any, Callable

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install
    triton = None
    tl = None

INSTALL_HINT = "install the GPU extra (pip install 'dspark[gpu]') or triton-ascend for the NPU ('dspark[npu]')"


def available() -> bool:
    """True when triton imported."""
    return triton is not None


class _Missing:
    """Stands in for a @triton.jit kernel when triton is absent; launching it says what to install."""

    def __init__(self, fn: Callable[..., Any]):
        self.__name__ = fn.__name__

    def __getitem__(self, grid: object) -> Callable[..., Any]:
        raise RuntimeError(f"Triton kernel {self.__name__} needs triton, which is not installed: {INSTALL_HINT}")


def jit(fn: Callable[..., Any]) -> Any:
    """`triton.jit(fn)`, or a placeholder without triton."""
    return triton.jit(fn) if triton is not None else _Missing(fn)


def constexpr(value: Any) -> Any:
    """`tl.constexpr(value)` for a module-level kernel constant (the plain value without triton)."""
    return tl.constexpr(value) if tl is not None else value
