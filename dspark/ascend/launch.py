"""Launch policy for dspark's Triton kernels on triton-ascend, and a static checker of kernel sources.

On Ascend the grid is bound to physical cores (`coreDim` <= 65535), so dspark launches `vector` kernels
with grid = vector-core count and `dot` kernels (`tl.dot`) with grid = AI-core count, and every kernel
loops persistently over its work items (`for item in tl.range(tl.program_id(0), n, tl.num_programs(0))`);
`dispatch.grid` applies the policy. triton-ascend lacks integer sorts and int64 atomics (ascend.md
section 1); `check_kernel_source` flags sources that would not port:

- `sort`: `tl.sort` / `tl.topk` (no int sorts on A2/A3; a float sort may be kept with `# ascend: float-sort`
  on its line);
- `atomic`: `tl.atomic_*` whose arguments name int64/fp64, or with `sem` other than acq_rel or `scope`
  other than gpu (the only settings triton-ascend accepts);
- `persistent`: `tl.program_id` used other than as the start of a `tl.range(pid, n, tl.num_programs(axis))`
  loop, or on an axis other than 0 (Ascend merges multi-axis grids);
- `grid`: a kernel launched with a grid that is not `dispatch.grid(n, device, <that kernel>)`;
- `kind`: a launched kernel without `@dispatch.kernel_kind("vector" | "dot")` above its `@jit`, or whose
  kind disagrees with its use of `tl.dot` (through the jit helpers of its module).

The checker sees names, not types: an int64 pointer handed to an atomic is caught by the kernel's tests
under `--device npu`, not here. `integer_compares()` lists the compares of every kernel's inner loops (the
persistent loop, the loops inside it, and those of the jit helpers) and whether each runs as fp32 on the
Ascend-shaped launch (`dspark.kernels.compare`) or stays integer (scalar code on the 910C); it infers
float operands from the source (float literals, `tl.float32` casts, `tl.dot` / exp / log results and names
assigned from them).
"""
from __future__ import annotations

import ast
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dspark.kernels import dispatch

MAX_GRID = dispatch.MAX_GRID
FLOAT_SORT_PRAGMA = "# ascend: float-sort"
_WIDE = ("int64", "uint64", "float64", "fp64")


@dataclass(frozen=True)
class KernelViolation:
    """One construct that would not run (or not run as written) on triton-ascend."""

    path: str
    line: int
    rule: str      # sort | atomic | persistent | grid | kind
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.message}"


@contextlib.contextmanager
def npu_launch_policy(device: object = None) -> Iterator[dict[str, int]]:
    """Launch on the NPU's core counts inside the block (vector kernels on the vector cores, `dot` kernels on
    the AI cores), whatever the tensors' device; yields {"vector": .., "dot": ..}."""
    from dspark.ascend import runtime

    cores = {"vector": runtime.vector_core_count(device), "dot": runtime.ai_core_count(device)}
    with dispatch.launch_policy("cores", cores):
        yield cores


def check_kernel_source(source: str, path: str = "<string>") -> list[KernelViolation]:
    """Violations of the Ascend kernel rules in one Python source."""
    tree = ast.parse(source, filename=path)
    lines = source.splitlines()
    kernels = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and any(_is_jit(d) for d in n.decorator_list)]
    out: list[KernelViolation] = []
    for fn in kernels:
        out += _check_kernel(fn, lines, path)
    names = {fn.name for fn in kernels}
    grids = {t.id: n.value for n in ast.walk(tree) if isinstance(n, ast.Assign) and _is_grid_call(n.value)
             for t in n.targets if isinstance(t, ast.Name)}
    launched = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in names:
            name = node.value.id
            launched.add(name)
            call = grids.get(node.slice.id) if isinstance(node.slice, ast.Name) else node.slice
            if not _is_grid_call(call) or _grid_kernel(call) != name:
                out.append(KernelViolation(path, node.lineno, "grid",
                                           f"{name} launched with grid {ast.unparse(node.slice)!r}; "
                                           f"use dispatch.grid(n, device, {name})"))
    out += _check_kinds([fn for fn in kernels if fn.name in launched], kernels, path)
    return sorted(out, key=lambda v: (v.line, v.rule))


@dataclass(frozen=True)
class LoopCompare:
    """One compare in a kernel's inner loop: fp32 on the Ascend-shaped launch, or integer (what remains)."""

    path: str
    line: int
    kernel: str
    text: str
    fp32: bool

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kernel}: {'fp32' if self.fp32 else 'int '} {self.text}"


_FP32_HELPERS = ("lt", "le", "first_where", "last_where")   # dspark.kernels.compare, under the FP32 switch
_FLOAT_CALLS = ("dot", "exp", "exp2", "log", "log2", "sqrt")


def integer_compares(directory: str | Path | None = None) -> list[LoopCompare]:
    """Every compare in the inner loops of the kernels under `directory` (default dspark.kernels)."""
    import dspark.kernels

    root = Path(directory) if directory is not None else Path(dspark.kernels.__file__).parent
    out: list[LoopCompare] = []
    for p in sorted(root.glob("*.py")):
        tree = ast.parse(p.read_text(), filename=str(p))
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and any(_is_jit(d) for d in fn.decorator_list):
                out += _loop_compares(fn, str(p))
    return out


def _loop_compares(fn: ast.FunctionDef, path: str) -> list[LoopCompare]:
    floats = _float_names(fn)
    seen: dict[int, LoopCompare] = {}
    for loop in ast.walk(fn):
        if not isinstance(loop, ast.For):
            continue
        for node in (n for stmt in loop.body for n in ast.walk(stmt)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in _FP32_HELPERS and ast.unparse(node.func.value) == "cmp":
                seen[id(node)] = LoopCompare(path, node.lineno, fn.name, ast.unparse(node), True)
            elif isinstance(node, ast.Compare) and not _inside_fp32_helper(node, loop):
                fp32 = any(_is_float(e, floats) for e in (node.left, *node.comparators))
                seen[id(node)] = LoopCompare(path, node.lineno, fn.name, ast.unparse(node), fp32)
    return sorted(seen.values(), key=lambda c: (c.line, c.text))


def _inside_fp32_helper(node: ast.AST, loop: ast.For) -> bool:
    return any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr in _FP32_HELPERS
               and any(n is node for n in ast.walk(c)) for c in ast.walk(loop))


def _float_names(fn: ast.FunctionDef) -> set[str]:
    """Names every assignment of which (in fn) is a float expression: the greatest fixpoint (a name that
    feeds itself, `m = tl.maximum(m, x)`, stays float unless one of its assignments is not)."""
    assigns: dict[str, list[ast.AST]] = {}
    for n in ast.walk(fn):
        if isinstance(n, (ast.Assign, ast.AugAssign)):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                if isinstance(t, ast.Name):
                    assigns.setdefault(t.id, []).append(n.value)
    floats = set(assigns)
    while True:
        drop = {k for k in floats if not all(_is_float(v, floats) for v in assigns[k])}
        if not drop:
            return floats
        floats -= drop


def _is_float(e: ast.AST, floats: set[str]) -> bool:
    """Whether an expression is a float tensor (compares and casts to ints are not)."""
    if isinstance(e, ast.Constant):
        return isinstance(e.value, float)
    if isinstance(e, ast.Name):
        return e.id in floats
    if isinstance(e, ast.BinOp):
        return _is_float(e.left, floats) or _is_float(e.right, floats)
    if isinstance(e, ast.UnaryOp):
        return _is_float(e.operand, floats)
    if isinstance(e, ast.Subscript):
        return _is_float(e.value, floats)
    if not isinstance(e, ast.Call):
        return False
    name = _tl_name(e.func) or (e.func.attr if isinstance(e.func, ast.Attribute) else None)
    if name == "to":
        return ast.unparse(e.args[0]) in ("tl.float32", "tl.float16", "tl.bfloat16") if e.args else False
    if name in _FLOAT_CALLS or name == "key_as_float":
        return True
    if name in ("zeros", "full", "ones"):
        return any(k.arg == "dtype" and "float" in ast.unparse(k.value) for k in e.keywords) or any(
            "float" in ast.unparse(a) for a in e.args[1:])
    if name == "where":
        return any(_is_float(a, floats) for a in e.args[1:])
    if name == "load":
        return False
    return any(_is_float(a, floats) for a in e.args) or (
        isinstance(e.func, ast.Attribute) and _is_float(e.func.value, floats))


def check_kernel_modules(directory: str | Path | None = None) -> dict[str, list[KernelViolation]]:
    """Violations per module of every `*.py` under `directory` (default: the dspark.kernels package)."""
    import dspark.kernels

    root = Path(directory) if directory is not None else Path(dspark.kernels.__file__).parent
    return {str(p): check_kernel_source(p.read_text(), str(p)) for p in sorted(root.glob("*.py"))}


def _check_kernel(fn: ast.FunctionDef, lines: list[str], path: str) -> list[KernelViolation]:
    out: list[KernelViolation] = []
    persistent = {id(n.iter.args[0]) for n in ast.walk(fn) if _is_persistent_range(n)}
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        name = _tl_name(node.func)
        if name in ("sort", "topk") and FLOAT_SORT_PRAGMA not in lines[node.lineno - 1]:
            out.append(KernelViolation(path, node.lineno, "sort",
                                       f"tl.{name} in {fn.name}: triton-ascend has no int32/int64 sort; "
                                       f"count-based selection instead, or mark a float sort {FLOAT_SORT_PRAGMA!r}"))
        elif name is not None and name.startswith("atomic_"):
            out += _check_atomic(node, name, fn.name, path)
        elif name == "program_id" and id(node) not in persistent:
            out.append(KernelViolation(path, node.lineno, "persistent",
                                       f"tl.program_id in {fn.name} outside a persistent "
                                       "tl.range(tl.program_id(0), n, tl.num_programs(0)) loop"))
    return out


def _check_kinds(launched: list[ast.FunctionDef], kernels: list[ast.FunctionDef],
                 path: str) -> list[KernelViolation]:
    """Each launched kernel declares a kind, and `dot` exactly when it (or a jit helper it calls) uses tl.dot."""
    by_name = {fn.name: fn for fn in kernels}
    out = []
    for fn in launched:
        kinds = [d for d in fn.decorator_list if isinstance(d, ast.Call) and ast.unparse(d.func).split(".")[-1]
                 == "kernel_kind"]
        declared = kinds[0].args[0].value if kinds and kinds[0].args and isinstance(kinds[0].args[0],
                                                                                     ast.Constant) else None
        if declared not in dispatch.KINDS:
            out.append(KernelViolation(path, fn.lineno, "kind",
                                       f"{fn.name} declares no kind: put @dispatch.kernel_kind('vector' or 'dot') "
                                       "above its @jit"))
            continue
        dots = _uses_dot(fn, by_name, set())
        if (declared == "dot") != dots:
            out.append(KernelViolation(path, fn.lineno, "kind",
                                       f"{fn.name} is declared {declared!r} but "
                                       f"{'uses' if dots else 'does not use'} tl.dot: declare "
                                       f"{'dot' if dots else 'vector'!r}"))
    return out


def _uses_dot(fn: ast.FunctionDef, kernels: dict[str, ast.FunctionDef], seen: set[str]) -> bool:
    seen.add(fn.name)
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            if _tl_name(node.func) == "dot":
                return True
            callee = node.func.id if isinstance(node.func, ast.Name) else None
            if callee in kernels and callee not in seen and _uses_dot(kernels[callee], kernels, seen):
                return True
    return False


def _check_atomic(node: ast.Call, name: str, kernel: str, path: str) -> list[KernelViolation]:
    text = ast.unparse(node)
    out = []
    if any(w in text for w in _WIDE):
        out.append(KernelViolation(path, node.lineno, "atomic",
                                   f"tl.{name} in {kernel} on a 64-bit value: no int64/fp64 atomics on Ascend"))
    for kw in node.keywords:
        want = {"sem": "acq_rel", "scope": "gpu"}.get(kw.arg or "")
        if want and not (isinstance(kw.value, ast.Constant) and kw.value.value == want):
            out.append(KernelViolation(path, node.lineno, "atomic",
                                       f"tl.{name} in {kernel} with {kw.arg}={ast.unparse(kw.value)}: "
                                       f"triton-ascend accepts only {kw.arg}={want!r}"))
    return out


def _is_persistent_range(node: ast.AST) -> bool:
    """`tl.range(tl.program_id(0), n, tl.num_programs(0))` (or builtin range) used as a loop iterator."""
    if not (isinstance(node, ast.For) and isinstance(node.iter, ast.Call)):
        return False
    call = node.iter
    if _tl_name(call.func) != "range" and not (isinstance(call.func, ast.Name) and call.func.id == "range"):
        return False
    if len(call.args) != 3:
        return False
    start, step = call.args[0], call.args[2]
    return _is_axis0(start, "program_id") and _is_axis0(step, "num_programs")


def _is_axis0(node: ast.AST, fn: str) -> bool:
    return (isinstance(node, ast.Call) and _tl_name(node.func) == fn and len(node.args) == 1
            and isinstance(node.args[0], ast.Constant) and node.args[0].value == 0)


def _tl_name(func: ast.AST) -> str | None:
    """`x` for `tl.x` / `triton.language.x`, else None."""
    if isinstance(func, ast.Attribute):
        base = ast.unparse(func.value)
        if base in ("tl", "triton.language", "language"):
            return func.attr
    return None


def _is_jit(dec: ast.AST) -> bool:
    target = dec.func if isinstance(dec, ast.Call) else dec
    text = ast.unparse(target)
    return text in ("triton.jit", "jit")


def _is_grid_call(node: ast.AST | None) -> bool:
    if not isinstance(node, ast.Call):
        return False
    text = ast.unparse(node.func)
    return text == "grid" or text.endswith(".grid")


def _grid_kernel(call: ast.Call) -> str | None:
    """The kernel a `dispatch.grid(n, device, kernel)` call sizes for (its third or `kernel=` argument)."""
    arg = call.args[2] if len(call.args) > 2 else next((k.value for k in call.keywords if k.arg == "kernel"), None)
    return arg.id if isinstance(arg, ast.Name) else None
