"""The bring-up ladder script runs on the CPU: metadata parts and rungs 1-4 through the NPU backend with the
emulated operator pass, device parts skip with reasons."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from dspark.ascend import RaggedGraphCapability

SCRIPT = Path(__file__).resolve().parents[2] / "perf" / "ascend_bringup.py"


@pytest.fixture(scope="module")
def bringup():
    spec = importlib.util.spec_from_file_location("ascend_bringup", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


def test_cpu_ladder_report(bringup, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    assert bringup.main(["--out", str(out), "--capability", str(tmp_path / "cap.json")]) == 0
    report = json.loads(out.read_text())
    status = {s["step"]: s["status"] for s in report["steps"]}
    assert status == {1: "cpu-pass", 2: "cpu-pass", 3: "cpu-pass", 4: "cpu-pass", 5: "cpu-pass", 6: "skip"}
    assert all(s["reason"] for s in report["steps"])
    names = {s["step"]: " | ".join(c["name"] for c in s["cpu_checks"]) for s in report["steps"]}
    for step, what in ((1, "NPU backend == default attention: compact, tiers"), (2, "tier 8 replay of verify_lens [1, 1]"),
                       (3, "2 gloo TP ranks: NPU-backend verify rows identical"),
                       (4, "the idle rank's forward writes no KV")):  # rungs 1-4 through the emulated operator
        assert what in names[step], (step, names[step])
    assert not report["supports_ragged_verify_graph"] and report["compact_request_runs"] == "static"
    assert RaggedGraphCapability.load(tmp_path / "cap.json").records == {}   # nothing verified without an NPU


def test_eager_checks_catch_a_wrong_layout(bringup, monkeypatch: pytest.MonkeyPatch) -> None:
    """A check that cannot fail proves nothing: feed static-width metadata as if it were ragged."""
    from dspark.ascend.metadata import AscendVerifyMetadata

    real = AscendVerifyMetadata.from_layout
    monkeypatch.setattr(AscendVerifyMetadata, "from_layout",
                        classmethod(lambda cls, layout, live, ratios=(4, 128), slots=None:
                                    real(type(layout).from_verify_lens([4] * layout.num_requests, width=4), live, ratios)
                                    if layout.tier is None else real(layout, live, ratios, slots)))
    checks = bringup.eager_case_checks("worked example", [2, 1, 4], [10, 127, 255])
    assert not all(c.ok for c in checks)
