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


def test_the_planner_alone_chooses_a_host_path() -> None:
    """The numpy host paths (survival, budget, allocation, layout) are chosen once per step, by the planner;
    the public functions run their torch formula, and the serving runtime builds its host-length layouts with
    numpy, said at the call (`host=True`)."""
    consults = {name: len(re.findall(r"dispatch\.use_host\(", text)) for name, text in _sources().items()
                if "use_host(" in text and name != DISPATCH}
    assert consults == {"plan/planner.py": 2}


def test_no_module_but_dispatch_defines_a_placement_predicate() -> None:
    defining = sorted(name for name, text in _sources().items()
                      if re.search(r"^def (use_host|use_kernel|use_triton|tracing)\(", text, re.M))
    assert defining == [DISPATCH]
