import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dspark import ProfileSample, ScheduleConfig, TierManifest, load_cost_model
from dspark.lab.sweep import (
    SweepTiming,
    budget_regret,
    dense_rows,
    fit_cost_models,
    profile_steps,
    step_timer,
    tier_rows,
)
from dspark.verify.layout import round_up_to_tier

TIERS = (8, 16, 24, 32, 48, 64)
W = 8
BATCHES = (1, 2, 4, 8)


def truth(b: int, rows: torch.Tensor) -> torch.Tensor:
    tier = torch.tensor([round_up_to_tier(int(m), TIERS) for m in rows.tolist()], dtype=torch.float64)
    return 1e-3 + 2e-5 * b + 2.5e-5 * tier


def test_pinned_and_dense_rows():
    assert tier_rows((8, 16), 2, 8) == [2, 6, 7, 8, 9, 10, 14, 15, 16]
    assert tier_rows((8, 16), 1, 8, offsets=(0,)) == [1, 8]
    assert tier_rows((4,), 3, 4, floor=2) == [6, 12]  # tier +- 2 all below the floor rows B*F = 6
    assert dense_rows(3, 4, floor=2) == list(range(6, 13))
    with pytest.raises(ValueError, match="floor 5 exceeds width W=4"):
        dense_rows(1, 4, floor=5)
    with pytest.raises(ValueError, match="num_requests must be an int >= 1, got 0"):
        tier_rows(TIERS, 0, 4)
    with pytest.raises(ValueError, match="strictly increasing"):
        tier_rows((16, 8), 1, 8)


class FakeAdapter:
    """Counts steps; each step's cost is its tier (no real timing needed for the bookkeeping)."""

    name = "fake"
    device = torch.device("cpu")

    def __init__(self):
        self.prepared: list[tuple[int, int]] = []
        self.steps = 0

    def prepare(self, num_requests, rows):
        self.prepared.append((num_requests, rows))

    def step(self):
        self.steps += 1


def test_profile_steps_interleaves_warms_up_and_takes_medians(monkeypatch):
    import dspark.lab.sweep as prof

    adapter = FakeAdapter()
    timed: dict = {}

    def fake_timer(device, clock):
        def timed_call(fn):
            fn()
            point = adapter.prepared[-1]
            timed[point] = timed.get(point, 0) + 1
            return point[1] + (1000.0 if timed[point] == 1 else 0.0)  # one outlier per point: the median drops it
        return timed_call

    monkeypatch.setattr(prof, "step_timer", fake_timer)
    seen = []
    pts = [(1, 3), (2, 5), (1, 3), (4, 9)]
    out = profile_steps(adapter, pts, timing=SweepTiming(warmup=2, repeats=3),
                        progress=lambda d, t: seen.append((d, t)))
    assert [(s.num_requests, s.rows, s.seconds) for s in out] == [(1, 3, 3.0), (2, 5, 5.0), (4, 9, 9.0)]
    assert adapter.steps == 3 * 3 * (2 + 1) and len(adapter.prepared) == 9
    passes = [adapter.prepared[i:i + 3] for i in (0, 3, 6)]
    assert all(sorted(p) == [(1, 3), (2, 5), (4, 9)] for p in passes)  # every pass visits every point once
    assert seen == [(d, 9) for d in range(1, 10)]
    with pytest.raises(ValueError, match="repeats must be an int >= 1, got 0"):
        SweepTiming(repeats=0)
    with pytest.raises(ValueError, match="stat must be one of"):
        SweepTiming(stat="mean")


def test_step_timer_measures_cpu_work():
    for clock in ("wall", "thread"):
        spent = step_timer(torch.device("cpu"), clock)(lambda: sum(range(200_000)))
        assert 0 < spent < 5
    with pytest.raises(ValueError, match="clock must be one of"):
        step_timer(torch.device("cpu"), "cycles")


def test_fit_cost_models_side_by_side_and_regret_of_an_exact_model_is_zero():
    samples = [ProfileSample(b, m, float(truth(b, torch.tensor([m]))[0]))
               for b in BATCHES for m in tier_rows(TIERS, b, W) if m <= TIERS[-1]]
    models = fit_cost_models(samples, tiers=TIERS, width=W, platform="cpu")
    assert set(models) == {"1-D", "additive", "tiered", "tiered-dense"} and models["tiered-dense"].table is not None
    assert models["1-D"].rows == tuple(b * W for b in BATCHES)  # the static diagonal only
    gen = torch.Generator().manual_seed(0)
    survivals = [torch.cumprod(torch.rand(b, W - 1, generator=gen) * 0.5 + 0.5, dim=1)
                 for b in BATCHES for _ in range(5)]
    res = budget_regret(survivals, models, truth, cfg=ScheduleConfig(gamma=W - 1), tiers=TIERS)
    for exact in ("tiered", "tiered-dense"):
        assert res[exact].mean == pytest.approx(0.0, abs=1e-12) and res[exact].wrong_tier_rate == 0.0
    assert res["additive"].max > 0.0 and res["1-D"].max > 0.0  # smooth / diagonal fits miss the staircase
    for r in res.values():
        assert 0.0 <= r.mean <= r.max and r.p90 <= r.max + 1e-12 and r.num_decisions == len(survivals)
    with pytest.raises(ValueError, match="at least one survival matrix"):
        budget_regret([], models, truth, cfg=ScheduleConfig(gamma=W - 1), tiers=TIERS)
    with pytest.raises(ValueError, match="static samples"):
        fit_cost_models([s for s in samples if s.rows != s.num_requests * W], tiers=TIERS, width=W)


def _load_perf(name: str):
    path = Path(__file__).resolve().parents[2] / "perf" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"perf_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tier_sweep_and_regret_scripts_end_to_end(tmp_path):
    """A tiny real sweep of the engine's verify step (tiny Llama), then the regret report against its dense oracle."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = _load_perf("tier_sweep").main(["--tiers", "4,8,16", "--width", "4", "--batches", "1,2,4", "--dense",
                                            "--repeats", "3", "--warmup", "0", "--clock", "thread",
                                            "--model", "tiny", "--context", "4",
                                            "--name", "t", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(old)
    assert rc == 0
    sweep = json.loads((tmp_path / "t.sweep.json").read_text())
    measured = {(s["num_requests"], s["rows"]) for s in sweep["samples"]}
    assert measured == {(b, m) for b in (1, 2, 4) for m in range(b, 4 * b + 1)}
    assert set(sweep["models"]) == {"1-D", "additive", "tiered", "tiered-dense"}
    assert (tmp_path / "t.png").stat().st_size > 0 and (tmp_path / "t.steps_per_second.json").exists()
    assert load_cost_model(tmp_path / "t.tiered_dense.json").table is not None
    assert load_cost_model(tmp_path / "t.tiered.json").tiers == (4, 8, 16)
    assert TierManifest.load(tmp_path / "t.tiers.json", width=4, platform="cpu").tiers == (4, 8, 16)
    out = tmp_path / "regret.json"
    recorded = torch.cumprod(torch.rand(4, 2, 3, generator=torch.Generator().manual_seed(1)), dim=2)
    torch.save(recorded, tmp_path / "rec.pt")
    assert _load_perf("cost_regret").main(["--sweep", str(tmp_path / "t.sweep.json"), "--per-batch", "3",
                                           "--survival", str(tmp_path / "rec.pt"), "--out", str(out)]) == 0
    regret = json.loads(out.read_text())["regret"]
    assert set(regret["synthetic"]) == {"1-D", "additive", "tiered", "tiered-dense"}
    assert regret["synthetic"]["tiered"]["num_decisions"] == 9 and regret["recorded"]["tiered"]["num_decisions"] == 4
