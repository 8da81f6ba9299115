"""Every Triton kernel in dspark/kernels compiles for a real GPU target (sm_90) without a GPU.

The interpreter accepts Python the compiler rejects (non-constexpr globals, type changes of loop-carried
values); compiling ahead of time catches those on a CPU-only machine. The compile runs in a child
process without TRITON_INTERPRET (under the interpreter, @triton.jit yields no compilable function).
Argument types follow the launchers: Python ints are i32 (strides too, at test sizes), floats fp32,
pointers the tensors' dtypes; constexprs and num_warps are what the launchers pass. The JIT turns an int
argument equal to 1 into constexpr 1, so unit strides of contiguous tensors (and a GQA group of 1) are
constexprs here as they are at launch.
`test_every_kernel_has_a_compile_case` keeps new kernels from skipping this.
"""
import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from dspark.kernels import accept as A
from dspark.kernels import kv_write as KV
from dspark.kernels import layout as L
from dspark.kernels import ragged_attention as RA
from dspark.kernels import topk as T

I32, I64 = "i32", "i64"
KERNELS_DIR = Path(__file__).resolve().parents[2] / "dspark" / "kernels"
SM90_MAX_SHARED = 232448  # bytes of shared memory one CTA may opt into on sm_90
_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


def _sig(kernel, types: dict[str, str], constexprs: dict) -> dict:
    names = kernel.arg_names
    sig = {n: types.get(n, I32) for n in names}
    sig.update({n: "constexpr" for n in constexprs})
    return sig


def _attention_case(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, max_q: int,
                    has_lse: bool, splits: int, page_size: int = 16):
    """`_ragged_attention_kernel` as `ragged_attention_triton` launches it on CUDA (and its merge if split)."""
    ptr = _PTR[dtype]
    dst = "*fp32" if splits > 1 else ptr  # split partials go to the fp32 workspace
    dst_lse = "*fp32" if splits > 1 or has_lse else ptr  # without lse the launcher passes `out` again
    dot_dtype = tl.float32 if dtype == torch.float32 else RA.tl_dtype(dtype)
    group = num_q_heads // num_kv_heads
    blocks = RA.kernel_blocks(group, head_dim, max_q, torch.device("cuda"))
    ones = dict.fromkeys(["stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_bp"]
                         + ["stride_lh"] * (has_lse or splits > 1) + ["group"] * (group == 1), 1)
    num_warps = blocks.pop("num_warps")
    cases = [(RA._ragged_attention_kernel,
              {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "o_ptr": dst, "lse_ptr": dst_lse, "bt_ptr": "*i32",
               "qo_start_ptr": "*i32", "slot_lens_ptr": "*i32", "seqused_ptr": "*i32", "prefix_ptr": "*i32",
               "work_ptr": "*i32", "count_ptr": "*i32",
               "qk_scale": "fp32"},
              {"HAS_LSE": has_lse or splits > 1, "PAGE_SIZE": page_size, "DOT_DTYPE": dot_dtype,
               "DOT_PRECISION": "ieee" if dot_dtype == tl.float32 else None, **blocks, **ones},
              {"num_warps": num_warps})]
    if splits > 1:
        cases.append((RA._merge_splits_kernel,
                      {"po_ptr": "*fp32", "pl_ptr": "*fp32", "o_ptr": ptr, "lse_ptr": "*fp32" if has_lse else ptr,
                       "row_slot_ptr": "*i32", "chunks_ptr": "*i32"},
                      {"HAS_LSE": has_lse, "BLOCK_H": triton.next_power_of_2(num_q_heads),
                       "BLOCK_D": triton.next_power_of_2(head_dim), "stride_pod": 1, "stride_plh": 1,
                       "stride_od": 1, **({"stride_lh": 1} if has_lse else {})}, {}))
    return cases


def _write_kv_case(src: torch.dtype, cache: torch.dtype, slots: str, heads: int, dim: int):
    """`_write_kv_kernel` with the tile sizes `write_kv_triton` picks."""
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(dim)
    return (KV._write_kv_kernel,
            {"k_ptr": _PTR[src], "v_ptr": _PTR[src], "kc_ptr": _PTR[cache], "vc_ptr": _PTR[cache], "slots_ptr": slots},
            {"BLOCK_R": max(1, min(16, 4096 // (block_h * block_d))), "BLOCK_H": block_h, "BLOCK_D": block_d,
             **dict.fromkeys(["stride_kd", "stride_vd", "stride_kcd", "stride_vcd"] + ["num_heads"] * (heads == 1), 1)},
            {})


CASES = [
    (L._qo_indptr_kernel, {"lens_ptr": "*i32", "out_ptr": "*i32"}, {"BLOCK": L.SCAN_BLOCK}, {}),
    (L._row_maps_kernel, {"slot_indptr_ptr": "*i32", "row_slot_ptr": "*i32", "row_within_ptr": "*i32"},
     {"BLOCK": L.ROW_BLOCK}, {}),
    (L._pack_kernel, {"src_ptr": "*bf16", "dst_ptr": "*bf16", "row_slot_ptr": "*i32", "row_within_ptr": "*i32",
                      "src_stride_b": I64, "fill": "fp32"}, {"BLOCK_D": 1024}, {}),
    (L._scatter_kernel, {"src_ptr": "*i64", "dst_ptr": "*i64", "qo_indptr_ptr": "*i32"}, {"BLOCK_D": 16}, {}),
    *[(A._row_argmax_kernel, {"logits_ptr": dt, "vl_ptr": "*i32", "start_ptr": "*i32", "out_ptr": "*i32"},
       {"PACKED": packed, "BLOCK_V": 1024}, {})
      for dt, packed in (("*bf16", True), ("*fp32", False))],
    *[(A._sampling_kernel, {"draft_ptr": "*i64", "q_ptr": "*fp32", "p_ptr": dt, "u_ptr": "*fp32", "vl_ptr": "*i32",
                            "start_ptr": "*i32", "correct_ptr": "*i32", "bonus_ptr": "*i64"},
       {"PACKED": packed, "BLOCK_V": 1024}, {}) for dt, packed in (("*fp32", True), ("*bf16", False))],
    (T._threshold_kernel, {"key_ptr": "*i32", "out_ptr": "*i32"}, {"BLOCK": 1024}, {}),
    (T._lens_kernel, {"key_ptr": "*i32", "thr_ptr": "*i32", "lens_ptr": "*i32"}, {"BLOCK_C": 8, "floor": 1}, {}),
    # (dtype, Hq, Hkv, head_dim, max_q, lse, splits): every dtype, head dim 64/128/256, lse on/off, 1 and >1
    # splits, a GQA group of 1 (BLOCK_Q raised to 16 for tl.dot) and 8 (the 8-warp 128 x 128 tile).
    *_attention_case(torch.float32, 8, 2, 64, 5, False, 1),
    *_attention_case(torch.bfloat16, 32, 4, 128, 16, True, 1),
    *_attention_case(torch.float16, 4, 4, 256, 3, True, 4, page_size=7),
    *_attention_case(torch.bfloat16, 16, 8, 256, 8, False, 2),
    *_attention_case(torch.float32, 2, 2, 128, 16, True, 8),
    _write_kv_case(torch.bfloat16, torch.bfloat16, "*i64", 8, 128),
    _write_kv_case(torch.float32, torch.float32, "*i32", 1, 64),
]


def compile_all() -> list[str]:
    """Compile every case for sm_90 (asserting it fits sm_90's shared memory); the names compiled."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    done = []
    for kernel, types, case_constexprs, options in CASES:
        defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
        # kernels with the fp32-compare switch (dspark.kernels.compare) compile in both forms
        for fp32 in (False, True) if "FP32" in defaults else (None,):
            constexprs = {**defaults, **case_constexprs, **({} if fp32 is None else {"FP32": fp32})}
            src = ASTSource(fn=kernel, signature=_sig(kernel, types, constexprs), constexprs=constexprs)
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
            name = kernel.fn.__name__
            assert compiled.asm["cubin"], name
            assert compiled.metadata.shared <= SM90_MAX_SHARED, (name, constexprs, compiled.metadata.shared)
            done.append(name + ("+fp32" if fp32 else ""))
    return done


def _jit_functions(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    return {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
            and any(ast.unparse(getattr(d, "func", d)) in ("triton.jit", "jit") for d in f.decorator_list)}


def _called_by_jit(paths: list[Path]) -> set[str]:
    """Names called (`f(...)` or `module.f(...)`) inside the jit functions of these modules."""
    return {n.func.id if isinstance(n.func, ast.Name) else n.func.attr for p in paths
            for f in _jit_functions(p).values() for n in ast.walk(f)
            if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}


def _jit_kernels(path: Path, called: set[str]) -> set[str]:
    """@triton.jit functions of a module that are launched (`f[grid](...)`) or called by no jit function."""
    tree = ast.parse(path.read_text())
    launched = {n.func.value.id for n in ast.walk(tree) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Subscript) and isinstance(n.func.value, ast.Name)}
    return {name for name in _jit_functions(path) if name in launched or name not in called}


def test_every_kernel_has_a_compile_case():
    root = KERNELS_DIR.parents[1]
    paths = sorted(KERNELS_DIR.rglob("*.py"))
    called = _called_by_jit(paths)
    found = {(".".join(p.relative_to(root).with_suffix("").parts), name) for p in paths
             for name in _jit_kernels(p, called)}
    covered = {(kernel.fn.__module__, kernel.fn.__name__) for kernel, _, _, _ in CASES}
    assert found, KERNELS_DIR
    assert found <= covered, f"Triton kernels without a compile case in CASES: {sorted(found - covered)}"


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    forms = [(k.fn.__name__, "FP32" in inspect.signature(k.fn).parameters) for k, _, _, _ in CASES]
    assert out.stdout.split() == [n for name, fp32 in forms for n in (name, name + "+fp32")[: 1 + fp32]]


if __name__ == "__main__":
    print("\n".join(compile_all()))
