"""The layout and accept kernels compile for a real GPU target (sm_90) without a GPU.

The interpreter accepts Python the compiler rejects (non-constexpr globals, type changes of loop-carried
values); compiling ahead of time catches those on a CPU-only machine. The compile runs in a child
process without TRITON_INTERPRET (under the interpreter, @triton.jit yields no compilable function).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from dspark.kernels import accept as A
from dspark.kernels import layout as L

I32, I64 = "i32", "i64"


def _sig(kernel, types: dict[str, str], constexprs: dict) -> dict:
    names = kernel.arg_names
    sig = {n: types.get(n, I32) for n in names}
    sig.update({n: "constexpr" for n in constexprs})
    return sig


CASES = [
    (L._qo_indptr_kernel, {"lens_ptr": "*i32", "out_ptr": "*i32"}, {"BLOCK": L.SCAN_BLOCK}),
    (L._row_maps_kernel, {"slot_indptr_ptr": "*i32", "row_slot_ptr": "*i32", "row_within_ptr": "*i32"},
     {"BLOCK": L.ROW_BLOCK}),
    (L._pack_kernel, {"src_ptr": "*bf16", "dst_ptr": "*bf16", "row_slot_ptr": "*i32", "row_within_ptr": "*i32",
                      "src_stride_b": I64, "fill": "fp32"}, {"BLOCK_D": 1024}),
    (L._scatter_kernel, {"src_ptr": "*i64", "dst_ptr": "*i64", "qo_indptr_ptr": "*i32"}, {"BLOCK_D": 16}),
    *[(A._greedy_kernel, {"draft_ptr": "*i64", "logits_ptr": dt, "vl_ptr": "*i32", "start_ptr": "*i32",
                          "correct_ptr": "*i32", "bonus_ptr": "*i64"}, {"PACKED": packed, "BLOCK_V": 1024})
      for dt, packed in (("*bf16", True), ("*fp32", False))],
    *[(A._sampling_kernel, {"draft_ptr": "*i64", "q_ptr": "*fp32", "p_ptr": dt, "u_ptr": "*fp32", "vl_ptr": "*i32",
                            "start_ptr": "*i32", "correct_ptr": "*i32", "bonus_ptr": "*i64"},
       {"PACKED": packed, "BLOCK_V": 1024}) for dt, packed in (("*fp32", True), ("*bf16", False))],
]


def compile_all() -> list[str]:
    """Compile every case for sm_90; the names of the kernels compiled."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    done = []
    for kernel, types, constexprs in CASES:
        src = ASTSource(fn=kernel, signature=_sig(kernel, types, constexprs), constexprs=constexprs)
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
        done.append(kernel.fn.__name__)
    return done


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [kernel.fn.__name__ for kernel, _, _ in CASES]


if __name__ == "__main__":
    print("\n".join(compile_all()))
