"""The prepared GPU check (`perf/device_check.sh`) in its dry mode: every step runs on the CPU over a tiny model
through the code the GPU call runs, and lands in $OUT; its step limits fit one 9-minute device call."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "perf" / "device_check.sh"
STEPS = ["env", "suite_kernels_verify", "suite_graphs_compile", "suite_rest", "attention_bench", "measure", "replay",
         "demo", "collect"]


def step_limits() -> dict[str, int]:
    """{step name: its timeout in seconds}, read from the script's `step NAME SECONDS ...` lines."""
    return {m[1]: int(m[2]) for m in re.finditer(r"^step (\w+) (\d+) ", SCRIPT.read_text(), re.M)}


@pytest.mark.cpu_only(reason="reads the device script's text")
def test_step_limits_fit_one_nine_minute_call() -> None:
    limits = step_limits()
    assert list(limits) == STEPS
    assert sum(limits.values()) <= 540, limits


@pytest.mark.cpu_only(reason="the dry mode of the GPU check runs on the CPU by definition")
def test_dry_run_writes_every_step_output(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    run = subprocess.run(["bash", str(SCRIPT), "--dry"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted(["device_check.log", "device_check.json", "env.json", "attention_bench.json",
                            "measure.json", "cpu-measured-tiny.json", "replay.json", "demo.json"])
    assert len(files) <= 8  # what a device call brings back
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert list(report["steps"]) == STEPS[:-1] and report["passed"] and report["missing"] == []
    assert report["failures"] == [] and report["timed_out"] == []
    out = report["outputs"]
    assert out["env"]["device"] == "cpu" and out["env"]["torch"] and out["env"]["copy_bytes_per_s"] > 0
    bench = out["attention_bench"]
    assert [(r["batch"], r["width"], r["prefix"]) for r in bench["rows"]] == [(1, 2, 64), (3, 4, 40)]
    for row in bench["rows"]:
        assert row["seconds"]["dspark"] > 0 and row["seconds"]["sdpa-per-request"] > 0
        assert row["max_abs_diff_vs_dspark"]["sdpa-per-request"] < 1e-4  # the baselines compute the same
        assert row["max_abs_diff_vs_dspark"]["flex"] < 1e-4
    measure = out["measure"]
    assert measure["layers_measured"] == 1 and measure["model"]["num_hidden_layers"] == 2
    assert "per-layer" in measure["layer_scaling"] and measure["per_layer_seconds"]
    assert set(measure["drafters"]) == {"causal-lm", "block", "ngram"} and measure["errors"] == {}
    from dspark.cost.serving import load_serving_cost

    cost = load_serving_cost(tmp_path / "cpu-measured-tiny.json", width=4)
    assert cost.name == measure["cost_name"] and cost.max_requests == 256
    # scaled to two layers: each cell is the one-layer profile plus one layer's seconds, so never less
    per_layer = {tuple(map(int, k.split(","))): v for k, v in measure["per_layer_seconds"].items()}
    assert all(v >= 0 for v in per_layer.values())
    for b in (1, 64, 256):
        assert 0 < cost.plain_seconds(b) and 0 < cost.verify.step_seconds(num_requests=b, rows=4 * b)
    replay = out["replay"]
    cells = replay["cells"]["1"]
    assert set(cells) == set(replay["policies"]) and all(c["tok_s"] > 0 for c in cells.values())
    assert 0 < replay["per_batch"]["1"]["adaptive_vs_best_fixed"] and "priced" in replay["how"]
    assert replay["complete"] and replay["skipped"] == {}
    # the GPU-timed replay: every policy ran the tiny target and drafter (SmolLM2 ids modulo its vocabulary)
    timed = replay["timed"]
    assert timed["batch_sizes"] == [1] and timed["skipped"] == {} and timed["errors"] == {} and timed["layers"] == 2
    assert timed["how"].startswith("timed:") and "modulo" in timed["how"] and timed["drafter"] == "ngram"
    assert set(timed["cells"]["1"]) == set(replay["policies"])
    assert all(c["tok_s"] > 0 and c["requests"] == 2 and c["full_concurrency"] for c in timed["cells"]["1"].values())
    beside = replay["per_batch"]["1"]["timed"]
    assert beside["best_fixed"] in replay["policies"] and beside["adaptive_vs_best_fixed"] > 0
    assert beside["adaptive_est_vs_best_fixed"] > 0
    shares = beside["planner_share_of_step"]
    assert 0 < shares["adaptive"] < 1 and 0 < shares["adaptive-est"] < 1 and "oracle" not in shares
    assert timed["planner_share_max"] == max(shares["adaptive"], shares["adaptive-est"])
    assert timed["planner_goal"] == 0.03 and timed["planner_goal_met"] == (timed["planner_share_max"] <= 0.03)
    assert out["demo"]["ran"] is False and out["demo"]["skipped"]
    log = (tmp_path / "device_check.log").read_text()
    assert all(f"== {s}: exit 0" in log for s in STEPS)
