"""perf/ngram_speedup.py at tiny scale (the tests' random Llama through the same code path): every section runs,
is checked lossless (against plain decoding and transformers' generate), and writes the fields perf/README.md
quotes, with speed-ups that are the medians of the per-round ratios."""
from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cpu_only(reason="a perf script at tiny scale on the CPU")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_tiny_run_writes_every_section(tmp_path: Path, one_thread: None) -> None:
    path = Path(__file__).resolve().parents[2] / "perf" / "ngram_speedup.py"
    spec = importlib.util.spec_from_file_location("perf_ngram_speedup", path)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    out = tmp_path / "ng.json"
    summary = script.main(["--model", "tiny", "--prompts", "2", "--new-tokens", "8", "--batch-new-tokens", "6",
                           "--ks", "2,3", "--batch-sizes", "2", "--rounds", "2", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["lossless"] and set(data["sections"]) == {"B=1", "B=2"}
    b1, b2 = data["sections"]["B=1"], data["sections"]["B=2"]
    assert set(b1["speedup"]) == {"fixed-0", "fixed-2", "fixed-3"} and "adaptive-est" in b2["speedup"]
    for sec in (b1, b2):
        for name, runs in sec["tok_s"].items():
            assert len(runs) == 2
            want = statistics.median(a / b for a, b in zip(runs, sec["tok_s"]["fixed-0"]))
            assert sec["speedup"][name] == pytest.approx(want)
    hf = data["transformers_b1"]
    assert set(hf["speedup"]) == {"plain", "lookup-2", "lookup-3"}
    assert data["ratio_of_ratios"] == pytest.approx(data["best_speedup_b1"] / data["transformers_best_speedup"])
    assert summary["best_fixed_b1"] in b1["speedup"]
