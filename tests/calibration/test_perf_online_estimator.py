"""perf/online_estimator.py at tiny scale (`--model tiny`: the tests' Llama and draft through the same code):
both parts run end to end, the JSON holds the fields perf/README.md describes, every adaptive run is lossless."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

PERF = Path(__file__).resolve().parents[2] / "perf"

pytestmark = pytest.mark.cpu_only(reason="a perf script's CPU smoke run at tiny scale")


def _script():
    spec = importlib.util.spec_from_file_location("perf_online_estimator", PERF / "online_estimator.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_writes_its_fields(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    out = tmp_path / "oe.json"
    try:
        summary = _script().main(["--model", "tiny", "--prompts", "16", "--new-tokens", "10", "--prompt-len", "8",
                                  "--gamma", "3", "--bootstrap", "5", "--batch-sizes", "1", "2", "--max-new-tokens",
                                  "6", "--requests-per-slot", "1", "--repeats", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text()) == json.loads(json.dumps(summary))
    summary = json.loads(out.read_text())
    cal = summary["calibration"]
    assert cal["held_out_requests"] == 4 and cal["estimator_refits"] == 10 // 4
    events = {(r["position"], r["event"]) for r in cal["rows"]}
    assert (0, "conditional") in events and (0, "cumulative") in events
    for r in cal["rows"]:
        for m in ("estimator", "estimator_online", "prior", "head_sts", "head_raw"):
            assert set(r[m]) == {"auroc", "ece_width"} and len(r[m]["ece_width"]["ci"]) == 2
        assert set(r["margin"]) == {"auroc"}
    tp = summary["throughput"]
    assert tp["lossless_vs_fixed0"] and set(tp["results"]) == {"1", "2"} and tp["estimator_steps"] > 0
    for r in tp["results"].values():
        assert set(r["tokens_per_s"]) == {"fixed-0", "fixed-1", "fixed-2", "fixed-3", "adaptive-head",
                                          "adaptive-estimator"}
        assert r["best_fixed"].startswith("fixed-") and r["adaptive-estimator_vs_best_fixed"] > 0
