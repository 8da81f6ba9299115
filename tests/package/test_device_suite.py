"""The suite runs on the device under test: every test takes `device` or is marked cpu_only with a reason,
and a run reports how many tests ran on the device."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CPU_ONLY_MODULES, takes_device

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.cpu_only(reason="an inventory of the collected tests")
def test_every_test_takes_the_device_or_is_marked_cpu_only(request: pytest.FixtureRequest) -> None:
    items = request.session.items
    unmarked = sorted({i.nodeid.split("[")[0] for i in items
                       if not takes_device(i) and i.get_closest_marker("cpu_only") is None})
    assert not unmarked, ("take the `device` fixture (and build the inputs on it), or mark "
                          f"@pytest.mark.cpu_only(reason=...): {unmarked}")
    no_reason = sorted({i.nodeid for i in items if (m := i.get_closest_marker("cpu_only")) is not None
                        and not m.kwargs.get("reason")})
    assert not no_reason, f"cpu_only needs reason=...: {no_reason}"
    both = sorted({i.nodeid for i in items if takes_device(i) and any(
        m.name == "cpu_only" for m in i.own_markers)})
    assert not both, f"a test that takes `device` is not cpu_only: {both}"


@pytest.mark.cpu_only(reason="docs/testing.md's list of CPU-only modules")
def test_testing_doc_lists_every_cpu_only_module() -> None:
    doc = (ROOT / "docs" / "testing.md").read_text()
    missing = [m for m in CPU_ONLY_MODULES if m not in doc]
    assert not missing, f"docs/testing.md should list {missing} with their reasons"
    gone = [m for m in CPU_ONLY_MODULES if not any((ROOT / "tests").glob(f"*/{m}"))]
    assert not gone, f"listed modules no longer exist: {gone}"


@pytest.mark.cpu_only(reason="runs pytest in a subprocess to read its summary line")
def test_a_run_reports_how_many_tests_ran_on_the_device() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--device", "cpu", "-p", "no:cacheprovider",
                          "tests/plan/test_survival.py", "tests/verify/test_graphs.py", "-k", "teaching or split_rows"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "dspark: 1 tests ran on --device cpu, 1 cpu_only tests on the CPU, 0 unmarked" in run.stdout, run.stdout
