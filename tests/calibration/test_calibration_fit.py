"""fit_sts / fit_temperatures: recovery of known temperatures, ECE collapse, bounds, policies, the margin
baseline, the Calibration JSON (validation, atomic save), reliability plots and the calibrate command."""
import json
import math

import numpy as np
import pytest
import torch

from dspark.calibration.fit import (
    Calibration,
    FitOptions,
    fit_sts,
    fit_temperatures,
    split_by_request,
)
from dspark.calibration.metrics import Sample, metric_functions
from dspark.calibration.plots import plot_reliability
from dspark.calibration.recorder import POLICIES, StsData, StsOutcome, StsRecorder
from dspark.cli import main as cli_main
from dspark.plan.survival import calibrated_survival

NO_BOOTSTRAP = FitOptions(bootstrap=0)


def synthetic(n, temps, seed, device, *, policy="greedy", censor=True, margin_signal=False, rid_offset=0,
              soft=False):
    """Rows whose true conditional accept probability is sigmoid(z / T_k); random verify lens censor."""
    g = len(temps)
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, g, generator=gen) * 2.5 + 3.0
    u = torch.rand(n, g, generator=gen)
    acc = u < torch.sigmoid(z / torch.tensor(temps))
    correct = torch.cumprod(acc.int(), 1).sum(1)
    vl = torch.randint(3, g + 2, (n,), generator=gen) if censor else torch.full((n,), g + 1)
    pos = torch.arange(g)
    labels = torch.where(pos < (vl - 1)[:, None], (pos < correct[:, None]).float(), float("nan"))
    # margin baseline: either a near-perfect predictor of the accept draw or noise
    margin = (torch.sigmoid(z / torch.tensor(temps)) - u) if margin_signal else torch.randn(n, g, generator=gen)
    proxy = torch.where(torch.isfinite(labels), torch.sigmoid(z), float("nan")) if soft else torch.full((n, g), float("nan"))
    return StsData(logits=z.to(device), labels=labels, soft=proxy, margin=margin,
                   verify_lens=vl.to(torch.int32), policy=torch.full((n,), POLICIES.index(policy), dtype=torch.int8),
                   request_ids=torch.arange(n) // 8 + rid_offset, steps=torch.arange(n) % 8)


def test_nll_fit_recovers_known_temperatures(device):
    temps = [0.5, 0.8, 1.3, 2.0]
    d = synthetic(100_000, temps, 0, device)
    fits = fit_temperatures(d.logits, d.labels, method="nll")
    got = [f.temperature for f in fits]
    assert all(abs(a / b - 1) < 0.05 for a, b in zip(got, temps)), got
    assert not any(f.at_bound or f.collapsed for f in fits)
    # censoring respected: draft 3 is observed only where verify_len - 1 > 3
    assert [f.rows for f in fits] == [int((d.verify_lens - 1 > k).sum()) for k in range(4)]
    assert fits[3].rows < 40_000


def test_fit_sts_report_improves_heldout_calibration(device):
    temps = [0.5, 2.0, 1.0]
    d = synthetic(12_000, temps, 1, device, soft=True)  # soft proxy = the uncalibrated sigmoid(z)
    cal = fit_sts(d, FitOptions(method="brier", bootstrap=10, num_bins=10))
    assert all(abs(a / b - 1) < 0.15 for a, b in zip(cal.temperatures, temps)), cal.temperatures
    assert cal.policy == "greedy" and cal.gamma == 3 and cal.warnings == []
    no_margin = fit_sts(StsData(**{**d.__dict__, "margin": torch.full_like(d.margin, float("nan"))}), NO_BOOTSTRAP)
    assert any("no margin baseline" in w for w in no_margin.warnings)
    assert "auroc_margin" not in no_margin.metrics["positions"][0]["cumulative"]
    assert cal.data["requests"] == 1500 and 0 < cal.data["heldout_requests"] < 1500
    p0 = cal.metrics["positions"][0]["cumulative"]
    assert p0["after"]["ece_width"]["value"] < p0["before"]["ece_width"]["value"]
    for name in ("ece_width", "ece_mass", "brier", "nll", "auroc"):
        lo, hi = p0["after"][name]["ci"]
        assert lo <= hi and math.isfinite(p0["after"][name]["value"])
    assert 0 < p0["ece_floor_after"]["width"] < 0.05 and 0 < p0["ece_floor_after"]["mass"] < 0.05
    proxy = p0["soft_proxy"]
    assert proxy["brier"]["value"] == pytest.approx(p0["before"]["brier"]["value"], rel=1e-5)
    pooled = cal.metrics["pooled_cumulative"]
    assert pooled["after"]["nll"]["value"] < pooled["before"]["nll"]["value"]
    assert cal.metrics["positions"][1]["conditional"]["rows"] < cal.metrics["positions"][1]["cumulative"]["rows"]


def test_ece_grid_collapse_on_tiny_data_is_reported(device):
    z = torch.tensor([[-1.0], [-0.5], [0.5], [1.0], [0.0], [0.8]], device=device)
    y = torch.tensor([[1.0], [0.0], [0.0], [1.0], [1.0], [0.0]])  # labels unrelated to z: ECE favors T -> big
    (fit,) = fit_temperatures(z, y, method="ece", num_bins=15)
    assert fit.collapsed and fit.occupied_bins_after == 1 and fit.occupied_bins_before > 1
    d = StsData(logits=z.cpu(), labels=y, soft=torch.full_like(y, float("nan")), margin=torch.full_like(y, float("nan")),
                verify_lens=torch.full((6,), 2, dtype=torch.int32), policy=torch.zeros(6, dtype=torch.int8),
                request_ids=torch.tensor([0, 0, 1, 1, 2, 3]), steps=torch.zeros(6, dtype=torch.int64))
    cal = fit_sts(d, FitOptions(method="ece", bootstrap=0, holdout_fraction=0.25))
    assert cal.metrics["fit"][0]["collapsed"]
    assert any("collapsed all" in w and "one ECE bin" in w for w in cal.warnings), cal.warnings


@pytest.mark.parametrize("method", ["nll", "brier"])
def test_the_fitter_scores_the_survival_the_planner_serves(method, device):
    """The objective the fitter minimized, at its own temperatures, is the objective of `calibrated_survival`
    with those temperatures (after the Calibration round trip), bit for bit: one formula, fitted and served."""
    d = synthetic(3_000, [0.6, 1.7, 1.1], 7, device)
    d.logits[::97, 1] = float("nan")
    d.logits[::89, 0] = float("-inf")
    fits = fit_temperatures(d.logits, d.labels, method=method)
    fitted = [f.temperature for f in fits]
    temps = Calibration(temperatures=fitted, gamma=3, policy="greedy", method=method).temperatures
    assert temps == fitted  # float32-exact: served unchanged
    served = calibrated_survival(d.logits, temps).cpu().numpy()
    metric = metric_functions(15)[method]
    for f in fits:
        obs = torch.isfinite(d.labels[:, f.position]).numpy()
        p, y = served[obs, f.position], d.labels[:, f.position].numpy()[obs]
        assert metric(Sample.build(p, y, sort=False), np.ones(p.size)) == f.score
        assert f.temperature not in (1.0, 0.05, 20.0)  # a fitted value, not a default or a bound


def test_temperature_at_search_bound_is_flagged(device):
    z = torch.linspace(0.5, 3.0, 40, device=device).reshape(40, 1)
    y = torch.ones(40, 1)  # always accepted: NLL keeps falling as T -> 0
    (fit,) = fit_temperatures(z, y, bounds=(0.1, 10.0))
    assert fit.at_bound and fit.temperature == pytest.approx(0.1, rel=1e-3)


def test_separate_fits_per_policy(device):
    greedy = synthetic(20_000, [0.5, 1.0], 2, device, policy="greedy")
    sampled = synthetic(20_000, [2.0, 1.0], 3, device, policy="sampling", rid_offset=10**6)
    mixed = StsData.concat([greedy, sampled])
    with pytest.raises(ValueError, match=r"mixes acceptance policies \['greedy', 'sampling'\]"):
        fit_sts(mixed, NO_BOOTSTRAP)
    g = fit_sts(mixed, NO_BOOTSTRAP, policy="greedy")
    s = fit_sts(mixed, NO_BOOTSTRAP, policy="sampling")
    assert g.temperatures[0] == pytest.approx(0.5, rel=0.1) and s.temperatures[0] == pytest.approx(2.0, rel=0.1)
    assert g.data["rows"] == s.data["rows"] == 20_000


def test_margin_baseline_comparison(device):
    strong = fit_sts(synthetic(4_000, [1.0, 1.0], 4, device, margin_signal=True), NO_BOOTSTRAP)
    assert strong.metrics["head_worse_than_margin"]["conditional"] == [0, 1]
    assert any("ranks worse" in w for w in strong.warnings)
    noise = fit_sts(synthetic(4_000, [1.0, 1.0], 4, device), NO_BOOTSTRAP)
    assert noise.metrics["head_worse_than_margin"] == {"conditional": [], "cumulative": []}
    rep = noise.metrics["positions"][0]["conditional"]
    assert rep["after"]["auroc"]["value"] > rep["auroc_margin"]["value"] + 0.1


def test_fit_bad_input(device):
    d = synthetic(64, [1.0, 1.0], 5, device)
    with pytest.raises(ValueError, match="empty STS data"):
        fit_sts(d.select(torch.zeros(64, dtype=torch.bool)))
    with pytest.raises(ValueError, match=r"at least 2 distinct request ids, got \[3\]"):
        split_by_request(torch.full((5,), 3), 0.25, 0)
    with pytest.raises(ValueError, match="no rows recorded under policy 'sampling'"):
        fit_sts(d, policy="sampling")
    with pytest.raises(ValueError, match="bounds.*2.0, 1.0"):
        fit_temperatures(d.logits, d.labels, bounds=(2.0, 1.0))
    with pytest.raises(ValueError, match="method.*'ece2'"):
        FitOptions(method="ece2")
    with pytest.raises(ValueError, match=r"holdout_fraction must be a number in \(0, 1\), got 1.5"):
        FitOptions(holdout_fraction=1.5)
    with pytest.raises(TypeError, match="options must be a FitOptions, got dict"):
        fit_sts(d, {"method": "nll"})
    nan = float("nan")
    with pytest.raises(ValueError, match=r"labels must be a contiguous prefix.*row 1 is \[1, 0, 1\]"):
        fit_temperatures(torch.zeros(2, 3), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]))
    with pytest.raises(ValueError, match=r"0/1.*labels\[0, 1\] = 0.5"):
        fit_temperatures(torch.zeros(1, 3), torch.tensor([[1.0, 0.5, 0.0]]))
    with pytest.raises(ValueError, match=r"censoring must be a suffix.*row 0 is \[1, 0, 1\]"):
        fit_temperatures(torch.zeros(1, 3), torch.tensor([[1.0, nan, 0.0]]))
    with pytest.raises(ValueError, match="non-empty"):
        fit_temperatures(torch.zeros(0, 3), torch.zeros(0, 3))
    bad = StsData(**{**d.__dict__, "labels": d.labels.clone()})
    bad.labels[0, :2] = torch.tensor([0.0, 1.0])
    bad.verify_lens[0] = 3
    with pytest.raises(ValueError, match=r"prefix.*row 0 is \[0, 1\]"):
        fit_sts(bad)


def _calibration(**over):
    kw = dict(temperatures=[1.0, 0.5, 2.0], gamma=3, policy="greedy", method="nll")
    kw.update(over)
    return Calibration(**kw)


@pytest.mark.cpu_only(reason="validation of temperatures in JSON files")
@pytest.mark.parametrize("temps, match", [
    ([1.0, 0.5], r"length gamma=3, got 2"),
    ([1.0, 0.0, 2.0], r"temperatures\[1\] = 0.0"),
    ([1.0, -3.0, 2.0], r"temperatures\[1\] = -3.0"),
    ([1.0, 2.0, float("nan")], r"temperatures\[2\] = nan"),
])
def test_calibration_rejects_bad_temperatures(temps, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        _calibration(temperatures=temps)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"temperatures": temps, "gamma": 3, "policy": "greedy", "method": "nll"}))
    with pytest.raises(ValueError, match=match) as err:
        Calibration.load(path)
    assert str(path) in str(err.value)


def test_calibration_json_roundtrip_and_validation(tmp_path, device):
    cal = _calibration(metrics={"x": float("nan")}, warnings=["w"])
    path = tmp_path / "c.json"
    cal.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]  # no temporary left behind
    back = Calibration.load(path)
    assert back.temperatures == [1.0, 0.5, 2.0] and back.metrics == {"x": None} and back.warnings == ["w"]
    assert back.temperatures_tensor(device).device.type == device.type
    with pytest.raises(ValueError, match="policy.*'beam'"):
        _calibration(policy="beam")
    path.write_text(json.dumps({"temperatures": [1.0], "gamma": 1, "policy": "greedy", "method": "nll", "extra": 1}))
    with pytest.raises(ValueError, match=r"unknown keys \['extra'\]"):
        Calibration.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable calibration JSON"):
        Calibration.load(path)


@pytest.mark.cpu_only(reason="the calibrate command over recorded shards (host files)")
def test_calibrate_command_writes_json_and_plots(tmp_path, capsys):
    d = synthetic(3_000, [0.7, 1.5], 6, torch.device("cpu"))
    with StsRecorder(tmp_path / "shards", gamma=2, shard_rows=1_000) as rec:
        for s in range(0, 3_000, 500):
            sl = slice(s, s + 500)
            rec.record(d.logits[sl], verify_lens=d.verify_lens[sl], request_ids=d.request_ids[sl],
                       outcome=StsOutcome(labels=torch.nan_to_num(d.labels[sl])), draft_logits=torch.randn(500, 2, 5))
    rc = cli_main(["calibrate", str(tmp_path / "shards"), "--out", str(tmp_path / "c.json"),
                         "--plots", str(tmp_path / "plots"), "--bootstrap", "5"])
    assert rc == 0
    out, err = capsys.readouterr()
    assert "load 3/3" in err and "fit 2/2" in err and "evaluate 2/2" in err and "\r" not in err  # log-file lines
    assert "AUROC margin" in out and "ECE floor" in out
    cal = Calibration.load(tmp_path / "c.json")
    assert cal.data["rows"] == 3_000 and cal.temperatures[0] == pytest.approx(0.7, rel=0.2)
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["reliability_pos0.png", "reliability_pos1.png"]
    assert plot_reliability(cal, tmp_path / "again")[0].read_bytes()[:4] == b"\x89PNG"  # from the loaded JSON
