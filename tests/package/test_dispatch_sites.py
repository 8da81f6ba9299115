"""Host vs device and traced vs eager are decided in one module, `dspark.kernels.dispatch`: every other module
asks it (`use_host`, `use_kernel`, `use_triton`, `tracing`) and none reads `torch.compiler.is_compiling` itself."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import dspark

pytestmark = pytest.mark.cpu_only(reason="static source checks")

ROOT = Path(dspark.__file__).parent
DISPATCH = "kernels/dispatch.py"


def _sources() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in ROOT.rglob("*.py")}


def test_only_dispatch_reads_whether_a_step_is_traced() -> None:
    readers = sorted(name for name, text in _sources().items() if "is_compiling" in text and name != DISPATCH)
    assert readers == [], f"ask dispatch.tracing() instead of torch.compiler.is_compiling() in {readers}"


def test_the_host_paths_are_the_three_the_architecture_names() -> None:
    """A numpy host path serves the survival, the budget's host plan and the layout build; nothing else."""
    consults = sorted(name for name, text in _sources().items()
                      if re.search(r"dispatch\.use_host\(", text) and name != DISPATCH)
    assert consults == ["plan/budget.py", "plan/survival.py", "verify/layout.py"]


def test_no_module_but_dispatch_defines_a_placement_predicate() -> None:
    defining = sorted(name for name, text in _sources().items()
                      if re.search(r"^def (use_host|use_kernel|use_triton|tracing)\(", text, re.M))
    assert defining == [DISPATCH]
