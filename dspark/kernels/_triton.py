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


def jit(fn: Callable[..., Any] | None = None, *, do_not_specialize: tuple[str, ...] = ()) -> Any:
    """`triton.jit(fn)`, or a placeholder without triton; `@jit(do_not_specialize=(names...))` for a kernel
    whose integer arguments `names` are runtime sizes or counts.

    Triton compiles one variant per specialisation key, and by default an int argument's key records whether
    it equals 1 and whether it is divisible by 16: a count that follows the data (rows, requests, items)
    would compile up to three variants mid-run, each a stall of hundreds of ms on a GPU. Arguments named
    here are keyed by type only (tests/kernels/test_specialization.py checks every launcher)."""
    if fn is None:
        return lambda f: jit(f, do_not_specialize=do_not_specialize)
    if triton is None:
        return _Missing(fn)
    return triton.jit(fn, do_not_specialize=list(do_not_specialize)) if do_not_specialize else triton.jit(fn)


def constexpr(value: Any) -> Any:
    """`tl.constexpr(value)` for a module-level kernel constant (the plain value without triton)."""
    return tl.constexpr(value) if tl is not None else value
