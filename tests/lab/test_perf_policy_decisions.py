"""perf/policy_decisions.py: the demo phases are medians over every round's full-batch steps only, the by-rows
groups take its speculative steps no prompt rode; a missing demo.json is refused with a message naming it; the lab
mode runs each depth alone and judges adaptive against the fixed-k runs only."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu_only(reason="a perf script's host arithmetic")
PATH = Path(__file__).resolve().parents[2] / "perf" / "policy_decisions.py"


def _script():
    spec = importlib.util.spec_from_file_location("perf_policy_decisions", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _step(batch: int, draft: float, rows: int, busy: int | None = None, folded: int = 0) -> dict:
    return {"batch": batch, "t_draft": draft, "t_plan": 1e-3, "t_verify": 0.1 + rows * 1e-3, "rows": rows,
            "proposed": 2 * batch, "t_accept": 2e-3, "t_prefill": 0.0, "useful": batch + 1, "committed": batch + 2,
            "folded_prefill": folded, "busy_slots": busy, "speculated": True}


def test_demo_phases_take_full_batch_steps_of_every_round(tmp_path: Path, capsys) -> None:
    rounds = [[_step(4, 0.010, 12), _step(4, 0.030, 8), _step(2, 0.900, 4)], [_step(4, 0.020, 12)]]
    path = tmp_path / "demo.json"
    path.write_text(json.dumps({"steps": {"adaptive@4": rounds}}))
    out = tmp_path / "phases.json"
    assert _script().main(["demo", "--demo-json", str(path), "--out", str(out)]) == 0
    got = json.loads(out.read_text())["adaptive@4"]
    assert got["steps"] == 3 and got["t_draft"] == pytest.approx(0.020) and got["rows"] == 12
    assert got["rows_seen"] == {"12": 2, "8": 1}  # the B = 2 tail step is left out
    assert _script().main(["demo", "--demo-json", str(tmp_path / "none.json")]) == 2
    assert "none.json is not a file" in capsys.readouterr().err


def test_demo_steady_window_counts_busy_steps_and_their_refill_seconds(tmp_path: Path) -> None:
    """The window is the steps with every slot busy (a refill's prompt riding one counts its slot); the
    refill share is the window's seconds in steps a prompt rode or was prefilled right before; a step without
    `useful` counts its committed tokens; without `busy_slots` there is no window."""
    run = [_step(4, 0.01, 8, busy=4), _step(3, 0.02, 6, busy=4, folded=31), _step(3, 0.03, 6, busy=3),
           _step(2, 0.04, 4, busy=2), {**_step(4, 0.05, 8, busy=4), "t_prefill": 0.2, "useful": None}]
    path = tmp_path / "demo.json"
    path.write_text(json.dumps({"steps": {"fixed-1@4": [run], "fixed-2@4": [[{**s, "busy_slots": None}
                                                                            for s in run]]}}))
    got = _script().demo(path)
    seconds = [s["t_draft"] + s["t_plan"] + s["t_verify"] + s["t_accept"] + s["t_prefill"] for s in run]
    whole, window = got["fixed-1@4"]["rounds"][0]["whole"], got["fixed-1@4"]["rounds"][0]["window"]
    assert whole == {"steps": 5, "tokens": 5 + 4 + 4 + 3 + 6, "seconds": pytest.approx(sum(seconds))}
    assert window["steps"] == 3 and window["tokens"] == 5 + 4 + 6 and window["refill_steps"] == 2
    assert window["seconds"] == pytest.approx(seconds[0] + seconds[1] + seconds[4])
    assert window["refill_step_seconds"] == pytest.approx(seconds[1] + seconds[4])
    assert got["fixed-2@4"]["rounds"][0]["window"] is None


def test_demo_groups_full_batch_speculative_steps_by_rows_and_counts_tail_steps(tmp_path: Path) -> None:
    """By rows: full-batch speculative steps no prompt rode (useful tokens, draft + plan + verify ms); a plain step,
    a folded prompt's step and a smaller batch's step are left out. Tail: per round, steps of fewer than B requests
    that no prompt rode."""
    runs = [[_step(4, 0.010, 12), _step(4, 0.030, 8), {**_step(4, 0.020, 4), "speculated": False},
             _step(4, 0.040, 12, folded=31), _step(3, 0.050, 6, folded=31), _step(2, 0.060, 4), _step(1, 0.07, 2)],
            [_step(4, 0.020, 12), _step(3, 0.080, 9)]]
    path = tmp_path / "demo.json"
    path.write_text(json.dumps({"steps": {"adaptive@4": runs}}))
    got = _script().demo(path)["adaptive@4"]
    assert _script().main(["demo", "--demo-json", str(path)]) == 0  # the printed table reads the same groups
    ms = [1e3 * (d + 1e-3 + 0.1 + r * 1e-3) for d, r in ((0.030, 8), (0.010, 12), (0.020, 12))]
    assert got["by_rows"] == {8: {"steps": 1, "tokens_per_step": 5.0, "ms_per_step": pytest.approx(ms[0])},
                              12: {"steps": 2, "tokens_per_step": 5.0, "ms_per_step": pytest.approx(sum(ms[1:]) / 2)}}
    assert got["tail_steps"] == [2, 1]
    # a demo that records each step's draft depth: the same rows at two depths are two groups
    runs[0][0]["drafted"], runs[0][1]["drafted"], runs[1][0]["drafted"] = 3, 1, 2
    path.write_text(json.dumps({"steps": {"adaptive@4": runs}}))
    got = _script().demo(path)["adaptive@4"]
    assert list(got["by_rows"]) == ["8 rows, k=1", "12 rows, k=2", "12 rows, k=3"]
    assert got["by_rows"]["12 rows, k=3"]["ms_per_step"] == pytest.approx(ms[1])


def test_lab_runs_each_depth_alone_and_reports_belief_beside_each_depths_run() -> None:
    """The lab mode runs adaptive with its depth choice off at every depth (the gate and that depth's planner) and
    reports what the gate believed of each depth beside what the run at that depth did, per request per step."""
    report = _script().lab("cpu-measured", 4)
    runs, depths = report["run_tok_s"], report["depths"]
    assert sorted(depths) == [1, 2, 3] and {f"adaptive depth {k}" for k in depths} <= set(runs)
    assert all(v > 0 for v in runs.values())
    for k, d in depths.items():
        accepted, verified = d["own"]
        assert d["own_steps"] > 0 and 0 < accepted <= verified <= k
        assert d["believed"] is not None and 0 < d["believed"][0] <= d["believed"][1] <= k


def test_lab_print_judges_adaptive_against_fixed_k_only(capsys, monkeypatch) -> None:
    """The best fixed policy is a fixed-k even where a single-depth adaptive run is faster; the best single depth is
    one of those runs; a depth whose run has fewer than 10 counted steps prints no belief line."""
    runs = {"fixed-0": 10.0, "fixed-1": 12.0, "fixed-2": 11.0, "fixed-3": 9.0, "adaptive": 13.0,
            "adaptive depth 1": 12.5, "adaptive depth 2": 14.0, "adaptive depth 3": 9.5}
    depths = {1: {"believed": [0.5, 0.8], "own_steps": 40, "own": [0.6, 1.0]},
              2: {"believed": [0.7, 1.1], "own_steps": 9, "own": [0.9, 1.9]},
              3: {"believed": None, "own_steps": 30, "own": [1.0, 2.0]}}
    report = {"cost": "x", "batch": 4, "decisions": 5, "plain_decisions": 1, "depths_when_speculating": {1: 4},
              "median_speculative_tok_s": 20.0, "plain_tok_s": 15.0,
              "last": {"realised_tok_s_by_depth": {1: 20.0}}, "partial_probes": {"count": 0}, "run_tok_s": runs,
              "depths": depths}
    script = _script()
    monkeypatch.setattr(script, "lab", lambda cost, b: report)
    assert script.main(["lab", "--cost", "x", "--batch", "4"]) == 0
    printed = capsys.readouterr().out
    assert "adaptive / best fixed (fixed-1) 1.083, / its best single depth (adaptive depth 2) 0.9286" in printed
    assert "depth 1: accepted / verified drafts per request per full-batch step, believed (median over " \
           "decisions) 0.500 / 0.800, its own run's 0.600 / 1.000 (40 steps)" in printed
    assert "depth 2:" not in printed and "depth 3:" not in printed
