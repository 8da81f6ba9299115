"""The prepared 910C check (`perf/npu_check.sh`) in its dry mode: every step runs on the CPU and lands in one
log and one JSON; a failing step fails the run."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["env", "ladder_single_rank", "ladder_tp_dp", "suite", "metadata_bench", "graph_kernel_bench"]


@pytest.mark.cpu_only(reason="the dry mode of the NPU check runs on the CPU by definition")
def test_dry_run_writes_one_log_and_one_json(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    run = subprocess.run(["bash", "perf/npu_check.sh", "--dry"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "npu_check.json").read_text())
    assert list(report["steps"]) == STEPS and all(s["exit"] == 0 for s in report["steps"].values())
    assert report["passed"] and report["missing"] == []
    assert report["suite"].startswith("dspark: ") and "--device cpu" in report["suite"]
    out = report["outputs"]
    assert out["env"]["device"] == "cpu"
    assert {s["step"]: s["status"] for s in out["ascend_bringup"]["steps"]}[1] == "cpu-pass"
    ranks = out["ranks"]
    assert ranks["passed"] and ranks["world"] == 3
    checks = [c for r in ranks["ranks"] for c in r["checks"]]
    assert "tp: a diverged rank raises on every rank" in checks and "dp: the idle rank is all ghosts" in checks
    assert set(out["bench"]["kernels_us"]) == {"topk.verify_lens", "layout.qo_indptr", "layout.pack",
                                               "accept.greedy", "attention.run"}
    assert all(v > 0 for v in out["bench"]["kernels_us"].values()) and out["bench"]["graph"]["replay_equals_eager"]
    assert out["ascend_metadata_bench"]
    log = (tmp_path / "npu_check.log").read_text()
    assert all(f"== {s}: exit 0" in log for s in STEPS)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".log", ".json")) == sorted(
        ["npu_check.log", "npu_check.json", "env.json", "ascend_bringup.json", "npu_capability.json", "ranks.json",
         "ascend_metadata_bench.json", "bench.json"])


@pytest.mark.cpu_only(reason="merges step files on the host")
def test_a_failed_or_missing_step_fails_the_run(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("npu_check", ROOT / "perf" / "npu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "steps.tsv").write_text("env 0 1\nsuite 1 30\n")
    (tmp_path / "env.json").write_text('{"device": "npu"}')
    report = mod.collect(tmp_path / "steps.tsv", [tmp_path / "env.json"], tmp_path / "none.log")
    assert report["steps"]["suite"] == {"exit": 1, "seconds": 30} and not report["passed"]
    (tmp_path / "steps.tsv").write_text("env 0 1\n")
    report = mod.collect(tmp_path / "steps.tsv", [tmp_path / "env.json", tmp_path / "bench.json"], tmp_path / "x")
    assert report["missing"] == ["bench.json"] and not report["passed"]
    assert mod.collect(tmp_path / "steps.tsv", [tmp_path / "env.json"], tmp_path / "x")["passed"]
