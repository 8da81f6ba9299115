"""perf/replay_live.py at tiny scale (`--model tiny`: the tests' models through the same code): every
(policy, B) cell is served live and replayed, the steps agree, the replay's tok/s equals the live tokens over
the cost model's price of the live steps, and the JSON and the PNG hold what perf/README.md quotes."""
from __future__ import annotations

import importlib.util
import json
import platform
import statistics
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cpu_only(reason="a perf script at tiny scale on the CPU")
PATH = Path(__file__).resolve().parents[2] / "perf" / "replay_live.py"


@pytest.fixture
def script():
    threads = torch.get_num_threads()
    spec = importlib.util.spec_from_file_location("perf_replay_live", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    torch.set_num_threads(threads)


def test_tiny_run_compares_every_cell_with_a_table_profiled_in_the_same_run(tmp_path: Path, script) -> None:
    out = tmp_path / "rl.json"
    script.main(["--model", "tiny", "--batch-sizes", "1,3", "--min-requests", "6", "--repeats", "2",
                 "--profile-repeats", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert data["cost_model"] == "same-run" and data["cost"]["parameters"]["batch_sizes"] == [1, 3]
    assert data["cost"]["per_kv_token"] >= 0 and any("profile_kv" in s for s in data["cost"]["sources"])
    assert set(data["cells"]) == {"1", "3"}
    assert [len(q["ids"]) for q in data["queues"].values()] == [1 + 6 + 1, 3 + 6 + 3]
    assert [q["measured"] for q in data["queues"].values()] == [[1, 7], [3, 9]]
    for b, rounds in data["machine_speed"].items():  # the canary ran in every round, full-batch steps at every depth
        assert len(rounds) == 2 and all(set(r) == {"0", "1", "2", "3"} for r in rounds)
        assert all(r[k]["rows"] == int(b) * (int(k) + 1) for r in rounds for k in r)  # full batches, every draft
        for x in (x for r in rounds for x in r.values()):
            assert x["steps"] > 0 and x["measured_s"] > 0
            assert x["error"] == pytest.approx(x["priced_s"] / x["measured_s"] - 1)
    for b, row in data["cells"].items():
        assert set(row) == set(script.POLICIES)
        for name, c in row.items():
            a = c["agreement"]
            assert a["identical"] == a["compared"] and a["differing_steps"] == 0 and a["diverging_requests"] == 0
            assert len(c["live_tok_s_runs"]) == 2 and c["live_tok_s"] == statistics.median(c["live_tok_s_runs"])
            assert c["replay_vs_priced_live"] == pytest.approx(0.0, abs=1e-9)  # the same steps, the same prices
            assert c["gap"] == pytest.approx(c["replay_tok_s"] / c["live_tok_s"] - 1)
            errors = [statistics.median(r[k]["error"] for r in data["machine_speed"][b]) for k in "0123"]
            assert min(errors) - 1e-12 <= c["speed"] <= max(errors) + 1e-12  # a seconds-weighted mean of them
            if name == "fixed-0":  # B rows at most, the plain canary's width: its speed
                assert c["speed"] == pytest.approx(errors[0])
            assert c["gap_at_round_speed"] == pytest.approx(c["replay_tok_s"] * (1 + c["speed"]) / c["live_tok_s"] - 1)
            assert c["full_concurrency"] and c["live_tok_s"] > 0
            ph = c["phases"]
            assert ph["plan"]["priced_s"] == 0.0 and ph["all"]["measured_s"] == pytest.approx(
                sum(ph[p]["measured_s"] for p in script.PHASES), rel=0.05)  # medians per phase: close, not equal
    assert data["within_goal_at_round_speed"] == sum(
        abs(c["gap_at_round_speed"]) <= data["goal"] for row in data["cells"].values() for c in row.values())
    assert data["cells_total"] == 12 and data["within_goal"] == sum(
        abs(c["gap"]) <= data["goal"] for row in data["cells"].values() for c in row.values())


@pytest.mark.parametrize("argv, error, match", [
    (["--min-requests", "0"], SystemExit, None),
    (["--cost", "nosuch"], SystemExit, "--cost nosuch: unknown serving cost 'nosuch'"),
    (["--batch-sizes", "64"], ValueError, "a queue of 256 requests needs 11 copies of each of the trace's 24"),
    (["--cost", "h100-llama8b-fitted"], SystemExit, "models platform 'h100-cuda' but the live run decodes on"),
    (["--cost", "{tmp}"], SystemExit, "serving cost '.*' is a folder, not a .json file"),
    (["--cost", "{other}"], SystemExit, "--cost .*other.json: cost 'cpu-measured' was profiled with the draft of "
                                        "sha256 41e61c47"),
])
def test_bad_input_is_refused_with_its_name(script, capsys, tmp_path, monkeypatch, argv, error, match) -> None:
    def no_live_work(*args, **kwargs):
        raise AssertionError("the live engine was built before the bad input was refused")

    monkeypatch.setattr(script, "SpecDecoder", no_live_work)
    other = tmp_path / "other.json"  # the real draft's CPU table, on this machine's platform: not the tiny trace's
    table = json.loads((PATH.parents[1] / "graphs" / "cost_models" / "cpu-measured.json").read_text())
    other.write_text(json.dumps({**table, "platform": f"{platform.machine()}-cpu"}))
    with pytest.raises(error, match=match):
        script.main(["--model", "tiny", *(a.format(tmp=tmp_path, other=other) for a in argv)])
    if error is SystemExit and match is None:
        assert "argument --min-requests: value must be an int >= 1, got 0" in capsys.readouterr().err
