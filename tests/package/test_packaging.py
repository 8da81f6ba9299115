"""Packaging: dspark imports and plans on the CPU without triton, the README's planner example runs as
written, each declared dependency is used, and the license the metadata names is there."""
from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]

WITHOUT_TRITON = r'''
import importlib.abc, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"{name} is blocked for this test")

sys.meta_path.insert(0, NoTriton())
import torch
import dspark
from dspark.kernels import _triton

assert not _triton.available() and "triton" not in sys.modules
cfg = dspark.ScheduleConfig(gamma=3)
cost = dspark.AdditiveCostModel(1e-3, dspark.BatchTerm([1], [0.0]), dspark.RowTerm([0, 16], [0.0, 1e-3]), width=4)
planner = dspark.VerifyPlanner(cfg, cost, dspark.PlannerSettings(lag=1, num_slots=4, tiers=(8, 16)))
logits = torch.tensor([[2.0, 1.0, -1.0], [0.5, 0.5, 0.5], [3.0, 3.0, 3.0]])
plan = planner.plan(logits, torch.arange(3), torch.zeros(3, dtype=torch.long))
print(plan.verify_lens.tolist(), plan.layout.tier, plan.layout.graph_num_tokens)
'''


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_import_and_a_cpu_planner_step_work_without_triton():
    out = _run(["-c", WITHOUT_TRITON])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[4, 4, 4] 16 16"  # the empty ring is optimistic: every draft verified


def test_the_readme_planner_example_is_the_tested_file_and_runs():
    example = (ROOT / "examples" / "planner.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "usage.md").read_text(), flags=re.S)
    assert example in blocks, "docs/usage.md's Planner API block must be examples/planner.py verbatim"
    out = _run(["examples/planner.py"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("budget ") and "planned" in out.stdout


def test_dependencies_are_used_and_extras_do_not_collide():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=;\[ ]", d)[0] for d in meta["dependencies"]]
    assert names == ["torch", "numpy"]
    extras = meta["optional-dependencies"]
    for name, reqs in extras.items():  # triton and triton-ascend cannot share an environment
        assert not ({"triton", "triton-ascend"} <= {re.split(r"[<>=;\[ ]", r)[0] for r in reqs}), name
    assert "einops" not in (ROOT / "constraints.txt").read_text()
    pinned = {line.split("==")[0] for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line}
    assert {"pip", "setuptools", "wheel", "triton"} <= pinned


def test_the_declared_license_file_is_there():
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_the_readme_quick_start_is_the_example_file_and_runs(capsys):
    """A newcomer pastes the README's quick start into a file: it is examples/quickstart.py, and it runs."""
    example = (ROOT / "examples" / "quickstart.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks and blocks[0] == example, "README's quick start must be examples/quickstart.py verbatim"
    runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="__main__")
    assert "tokens/s; ended by" in capsys.readouterr().out


def test_every_markdown_link_resolves():
    """Relative links of README.md, docs/ and the graphs / perf READMEs point at files that exist."""
    pages = [ROOT / "README.md", ROOT / "perf" / "README.md", ROOT / "graphs" / "README.md",
             *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "graphs").glob("*/README.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
