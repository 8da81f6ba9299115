"""Imports point down the stages (DESIGN.md section 3): a module imports only from its own stage or below, the
serving runtime (`serve/`) never imports its tools (`lab/`), and `cost/` imports no engine code. Read from the
source (every import statement, lazy and type-checking ones included), not from what happens to be loaded."""
from __future__ import annotations

import ast
from pathlib import Path

import dspark

ROOT = Path(dspark.__file__).parent
# bottom to top; a stage may import its own rank or lower
ORDER = [("config", "util", "telemetry"), ("kernels",), ("verify", "cost"), ("ascend", "parallel"), ("plan",),
         ("calibration",), ("models",), ("serve",), ("lab",), ("cli",)]
RANK = {stage: rank for rank, stages in enumerate(ORDER) for stage in stages}


def _imports() -> list[tuple[str, int, str, str]]:
    """(file, line, its stage, the dspark stage it imports) for every dspark import inside the package."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("").parts
        if rel == ("__init__",):
            continue  # the flat public API re-exports every stage
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if name.startswith("dspark."):
                    found.append((str(path.relative_to(ROOT)), node.lineno, rel[0], name.split(".")[1]))
    return found


def test_every_stage_is_ranked() -> None:
    stages = {p.name if p.is_dir() else p.stem for p in ROOT.iterdir()
              if not p.name.startswith("_") and (p.is_dir() or p.suffix == ".py")}
    assert stages - {"__pycache__"} == set(RANK)


def test_imports_point_down_the_stages() -> None:
    up = [f"{f}:{line} ({stage}) imports dspark.{target}" for f, line, stage, target in _imports()
          if RANK[target] > RANK[stage]]
    assert not up, "\n".join(up)


def test_the_runtime_never_imports_the_lab_and_cost_no_engine_code() -> None:
    found = _imports()
    assert not [x for x in found if x[2] == "serve" and x[3] == "lab"]
    assert not [x for x in found if x[2] == "cost" and x[3] in ("serve", "lab", "models", "plan")]
    assert any(x[2] == "lab" and x[3] == "serve" for x in found)  # the reader sees the imports it checks


def test_no_relative_imports() -> None:
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            assert not (isinstance(node, ast.ImportFrom) and node.level), f"{path}:{node.lineno}"
