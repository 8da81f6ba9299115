"""Public callables outside kernels/ take at most 7 parameters (self / cls not counted): settings travel as
checked objects (`EngineConfig`, `SamplingParams`, `GateSettings`, `PlannerSettings`, `AttentionShape`, ...).
Read from the source."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dspark

pytestmark = pytest.mark.cpu_only(reason="reads the source")

ROOT = Path(dspark.__file__).parent
MOST = 7
# signatures another library fixes: transformers calls a registered attention function with these arguments
INTERFACES = {"models/transformers_lm.py:paged_attention"}


def _public_callables() -> dict[str, int]:
    """{file:qualified name: parameter count} of every public function, method and __init__ outside kernels/."""
    found: dict[str, int] = {}

    def visit(body: list[ast.stmt], where: str, prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit(node.body, where, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name.startswith("_") and node.name != "__init__":
                    continue
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
                if names and names[0] in ("self", "cls") and prefix:
                    names = names[1:]
                found[f"{where}:{prefix}{node.name}"] = len(names)

    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "kernels" or any(p.startswith("_") and p != "__init__.py" for p in rel.parts):
            continue
        visit(ast.parse(path.read_text()).body, rel.as_posix(), "")
    return found


def test_public_callables_take_at_most_seven_parameters() -> None:
    found = _public_callables()
    assert "serve/generate.py:generate" in found and "serve/engine.py:SpecDecoder.generate" in found
    wide = {k: n for k, n in found.items() if n > MOST and k not in INTERFACES}
    assert not wide, f"more than {MOST} parameters (group them in a settings object): {wide}"


def test_the_serving_entry_points_are_narrow() -> None:
    found = _public_callables()
    for name in ("serve/generate.py:generate", "serve/engine.py:SpecDecoder.__init__",
                 "serve/engine.py:SpecDecoder.generate", "serve/engine.py:SpecDecoder.start",
                 "verify/attention.py:RaggedVerifyAttention.__init__", "serve/policies/adaptive.py:Adaptive.__init__",
                 "serve/policies/registry.py:make_policy", "serve/step.py:serve"):
        assert found[name] <= MOST, (name, found[name])


def test_no_public_unchecked_twins() -> None:
    """The public edge validates and what runs inside is private: no public `*_checked` / `*_unchecked` callable
    beside its checked twin."""
    twins = [k for k in _public_callables() if k.rsplit(".", 1)[-1].split(":")[-1].endswith(("_checked", "_unchecked"))]
    assert not twins, f"make the trusting inner function private (a leading underscore): {twins}"
