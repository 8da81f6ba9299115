import json
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark import (
    AdditiveCostModel,
    BatchTerm,
    CostModel,
    FitReport,
    ProfileSample,
    RowTerm,
    StepsPerSecondTable,
    load_cost_model,
    register_cost_model,
)
from dspark.cost import SCHEMA_VERSION, bin_rows
from dspark.util.fileio import atomic_write, read_json


def sps() -> StepsPerSecondTable:
    return StepsPerSecondTable([8, 16, 64], [100.0, 80.0, 20.0], platform="test-gpu", width=8)


def additive() -> AdditiveCostModel:
    return AdditiveCostModel(1e-3, BatchTerm([1, 8], [0.0, 2e-3]), RowTerm([0, 64, 128], [0.0, 1e-3, 4e-3]),
                             platform="test-npu")


def test_floor_lookup_scalar_and_vectorized(device):
    t = sps()
    rows = [0, 7, 8, 15, 16, 63, 64, 1000]
    want = [1 / 100, 1 / 100, 1 / 100, 1 / 100, 1 / 80, 1 / 80, 1 / 20, 1 / 20]
    assert [t.step_seconds(4, m) for m in rows] == pytest.approx(want)
    got = t.step_seconds(4, torch.tensor(rows, device=device))
    assert got.dtype == torch.float64 and got.device.type == device.type
    assert got.tolist() == [t.step_seconds(4, m) for m in rows]
    assert isinstance(t.step_seconds(4, 8), float)


def test_additive_interpolates_and_clamps(device):
    m = additive()
    assert m.step_seconds(1, 0) == pytest.approx(1e-3)
    assert m.step_seconds(8, 64) == pytest.approx(1e-3 + 2e-3 + 1e-3)
    assert m.step_seconds(4, 96) == pytest.approx(1e-3 + 2e-3 * 3 / 7 + 2.5e-3)
    assert m.step_seconds(100, 10_000) == pytest.approx(1e-3 + 2e-3 + 4e-3)  # held at the end values
    rows = torch.tensor([[0, 32], [96, 500]], device=device)
    got = m.step_seconds(4, rows)
    assert got.shape == (2, 2)
    assert got.flatten().tolist() == [m.step_seconds(4, v) for v in [0, 32, 96, 500]]


def test_bin_rows_rounds_half_up():
    assert [bin_rows(m, 64) for m in (1, 31, 32, 95, 96, 200)] == [0, 0, 64, 64, 128, 192]


def test_sps_fit_takes_the_median():
    samples = [ProfileSample(1, 8, 0.010), ProfileSample(1, 8, 0.030), ProfileSample(2, 8, 0.020),
               ProfileSample(2, 16, 0.040)]
    model, report = StepsPerSecondTable.fit(samples, platform="cpu")
    assert model.rows == (8, 16) and model.steps_per_second == pytest.approx((50.0, 25.0))
    assert report.num_samples == 4 and report.residuals == pytest.approx((-0.01, 0.01, 0.0, 0.0))
    assert model.fit_report == report


@settings(max_examples=10)
@given(alpha=st.lists(st.floats(0, 5e-3), min_size=3, max_size=3),
       theta=st.lists(st.floats(0, 5e-3), min_size=4, max_size=4), bias=st.floats(1e-4, 1e-2))
def test_additive_fit_recovers_an_additive_truth(alpha, theta, bias):
    batches, bins = [1, 4, 16], [64, 128, 192, 256]
    truth = {(b, m): bias + alpha[i] + theta[j] for i, b in enumerate(batches) for j, m in enumerate(bins)}
    samples = [ProfileSample(b, m, t) for (b, m), t in truth.items()]
    model, report = AdditiveCostModel.fit(samples, platform="cpu")
    assert model.batch_probes == tuple(batches) and model.row_probes == tuple(bins)
    for (b, m), t in truth.items():
        assert model.step_seconds(b, m) == pytest.approx(t, abs=1e-12)
    assert report.rms < 1e-12
    if max(truth.values()) - min(truth.values()) > 1e-6:
        assert report.r2 == pytest.approx(1.0, abs=1e-9)
    assert report.extras["row_bin"] == 64


def test_additive_fit_reports_residuals_of_a_noisy_fit():
    gen = torch.Generator().manual_seed(0)
    samples = [ProfileSample(b, m, 1e-3 + 1e-4 * b + 2e-5 * m + 1e-5 * float(torch.rand((), generator=gen)))
               for b in (1, 2, 4, 8) for m in (8, 64, 100, 256) if m >= b]
    model, report = AdditiveCostModel.fit(samples)
    assert len(report.residuals) == report.num_samples == len(samples)
    assert report.rms == pytest.approx(math.sqrt(sum(r * r for r in report.residuals) / len(samples)))
    assert 0.9 < report.r2 <= 1.0


@settings(max_examples=20)
@given(seed=st.integers(0, 2**32 - 1), noise=st.floats(0, 2e-3))
def test_convex_rows_fit_is_non_decreasing_convex_and_exact_on_a_convex_truth(seed, noise):
    rng = np.random.default_rng(seed)
    batches, rows = [1, 4, 16], [4, 8, 16, 32, 64, 112]
    alpha = dict(zip(batches, [0.0, *rng.uniform(0, 3e-3, 2)]))
    slopes = np.cumsum(rng.uniform(0, 1e-4, len(rows) - 1))  # non-decreasing slopes: convex theta
    theta = dict(zip(rows, np.concatenate([[0.0], np.cumsum(slopes * np.diff(rows))])))
    truth = {(b, m): 2e-3 + alpha[b] + theta[m] for b in batches for m in rows if m >= b}
    exact, _ = AdditiveCostModel.fit([ProfileSample(b, m, t) for (b, m), t in truth.items()], row_bin=1,
                                     convex_rows=True)
    for (b, m), t in truth.items():
        assert exact.step_seconds(b, m) == pytest.approx(t, abs=1e-12)
    noisy = [ProfileSample(b, m, t + noise * float(rng.uniform())) for (b, m), t in truth.items()]
    model, report = AdditiveCostModel.fit(noisy, row_bin=1, convex_rows=True)
    th = np.array(model.theta)
    assert model.row_probes == tuple(rows) and th[0] == 0.0
    assert (np.diff(th) >= -1e-15).all()
    slope = np.diff(th) / np.diff(rows)
    assert (np.diff(slope) >= -1e-12).all()
    assert report.extras["convex_rows"] is True and len(report.residuals) == len(noisy)


@pytest.mark.parametrize("convex_rows", [False, True])
@pytest.mark.parametrize("row_bin", [1, 64])
def test_rank_deficient_design_is_refused(convex_rows, row_bin):
    """A diagonal sweep (each B at one row count) cannot split alpha(B) from theta(M): every fit refuses it
    (the convex fit once accepted it with theta = 0, so rows looked free)."""
    diagonal = [ProfileSample(b, 8 * b, 1e-3 * b) for b in (8, 16, 32, 64)]
    with pytest.raises(ValueError, match=r"rank-deficient design: rank 4 < 7 parameters .*confounded"):
        AdditiveCostModel.fit(diagonal, row_bin=row_bin, convex_rows=convex_rows)


def test_json_round_trip_and_fingerprint(tmp_path):
    for model in (sps(), additive()):
        path = model.save(tmp_path / f"{model.kind}.json")
        loaded = load_cost_model(path)
        assert type(loaded) is type(model) and loaded == model
        assert loaded.fingerprint() == model.fingerprint() and len(model.fingerprint()) == 64
        assert type(model).load(path) == model
        assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION
    fitted, _ = StepsPerSecondTable.fit([ProfileSample(1, 8, 0.01)])
    again = load_cost_model(fitted.save(tmp_path / "fitted.json"))
    assert again.fit_report == fitted.fit_report
    assert sps().fingerprint() != StepsPerSecondTable([8, 16, 64], [100.0, 80.0, 21.0], platform="test-gpu",
                                                      width=8).fingerprint()
    assert list(tmp_path.glob(".*tmp")) == []


def _write(tmp_path, d):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize("change, needle", [
    ({"schema_version": 99}, "schema_version must be 1, got 99"),
    ({"kind": "magic"}, "unknown cost model kind 'magic'"),
    ({"rows": [8, 8, 64]}, "sorted and unique"),
    ({"rows": [16, 8, 64]}, "rows[0] = 16 then rows[1] = 8"),
    ({"rows": [8, 16]}, "one value per probe (2)"),
    ({"steps_per_second": [100.0, -1.0, 20.0]}, "steps_per_second[1] must be finite and > 0, got -1.0"),
    ({"steps_per_second": [100.0, "fast", 20.0]}, "'fast'"),
    ({"rows": [8, 16.5, 64]}, "rows[1] must be an int >= 1 and <= 1048576, got 16.5"),
    ({"rows": [8, 16, 2**21]}, "rows[2] must be an int >= 1 and <= 1048576, got 2097152"),
    ({"rows": []}, "rows must not be empty"),
    ({"width": 1}, "width"),
    ({"platform": ""}, "platform"),
])
def test_load_validation_names_the_problem(tmp_path, change, needle):
    path = _write(tmp_path, {**sps().to_dict(), **change})
    with pytest.raises(ValueError) as info:
        load_cost_model(path)
    assert needle in str(info.value) and str(path) in str(info.value)


def test_load_errors_for_corrupt_files(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"kind": "steps_per_')
    with pytest.raises(ValueError, match=r"bad\.json is not valid JSON"):
        load_cost_model(path)
    d = sps().to_dict()
    del d["steps_per_second"]
    with pytest.raises(ValueError, match="missing field 'steps_per_second'"):
        load_cost_model(_write(tmp_path, d))
    with pytest.raises(ValueError, match="expected kind 'additive'"):
        AdditiveCostModel.load(sps().save(tmp_path / "sps.json"))
    with pytest.raises(ValueError, match="JSON object"):
        load_cost_model(_write(tmp_path, [1, 2]))
    d = additive().to_dict()
    d["theta"] = [-5.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="step time must be > 0"):
        load_cost_model(_write(tmp_path, d))


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    def half_then_fail(p):
        p.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(tmp_path / "x.json", half_then_fail)
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_and_read_json_refuse_a_folder_or_a_file_in_the_path_naming_it(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="it is a folder; pass a file path"):
        atomic_write(tmp_path, lambda p: p.write_text("{}"))
    with pytest.raises(ValueError, match=r"afile' is a file, not a folder"):
        atomic_write(tmp_path / "afile" / "x.json", lambda p: p.write_text("{}"))
    with pytest.raises(ValueError, match=r"is a folder, not a JSON file"):
        read_json(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing half-written


@pytest.mark.parametrize("args, exc, needle", [
    ((0, 8, 0.1), ValueError, "num_requests must be an int >= 1, got 0"),
    ((4, 2, 0.1), ValueError, "rows must be an int >= num_requests=4"),
    ((1, 8, 0.0), ValueError, "seconds must be finite and > 0, got 0.0"),
    ((1, 8, math.nan), ValueError, "nan"),
    ((1.0, 8, 0.1), ValueError, "1.0"),
])
def test_bad_profile_samples(args, exc, needle):
    with pytest.raises(exc, match=needle.replace("(", r"\(").replace(")", r"\)")):
        ProfileSample(*args)


def test_bad_lookups_and_fits():
    with pytest.raises(ValueError, match="num_requests must be an int >= 0, got -1"):
        sps().step_seconds(-1, 8)
    with pytest.raises(ValueError, match="rows must be >= 0, got -3"):
        sps().step_seconds(1, -3)
    with pytest.raises(TypeError, match="2.5"):
        sps().step_seconds(1, 2.5)
    with pytest.raises(TypeError, match="torch.bool"):
        sps().step_seconds(1, torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="at least one"):
        AdditiveCostModel.fit([])
    with pytest.raises(TypeError, match=r"samples\[0\]"):
        StepsPerSecondTable.fit([(1, 8, 0.1)])
    with pytest.raises(ValueError, match="row_bin must be an int >= 1, got 0"):
        AdditiveCostModel.fit([ProfileSample(1, 8, 0.1)], row_bin=0)


def test_registry_plugs_in_new_kinds_and_rejects_clashes(tmp_path):
    with pytest.raises(ValueError, match="already registered"):
        register_cost_model(type("Clash", (StepsPerSecondTable,), {"kind": "additive"}))
    with pytest.raises(TypeError, match="kind"):
        register_cost_model(type("NoKind", (CostModel,), {}))

    @register_cost_model
    class FlatForTest(StepsPerSecondTable):
        kind = "flat_for_test"

    loaded = load_cost_model(FlatForTest([4], [10.0]).save(tmp_path / "flat.json"))
    assert type(loaded) is FlatForTest and loaded.step_seconds(1, 9) == pytest.approx(0.1)


def test_fit_report_round_trip():
    r = FitReport.from_predictions([1.0, 2.0, 3.0], [1.5, 2.0, 2.5], extras={"tier_errors": {"64": 0.1}})
    assert r.residuals == (-0.5, 0.0, 0.5) and r.r2 == pytest.approx(0.75)
    assert FitReport.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    with pytest.raises(ValueError, match="missing"):
        FitReport.from_dict({"rms": 1.0})


class ConstantForTest(CostModel):
    """A model without a dense table: seconds_curve falls back to step_seconds."""

    kind = "constant_for_test"

    def _tables(self):
        return ((0.5,),)

    def _seconds(self, num_requests, rows, tables):
        return tables[0].expand(rows.shape) + 0.001 * num_requests

    def _payload(self):
        return {}

    @classmethod
    def _from_payload(cls, d, **common):
        return cls(**common)

    @classmethod
    def fit(cls, samples, **kwargs):
        raise NotImplementedError


@pytest.mark.parametrize("model", [sps(), additive(), ConstantForTest()], ids=["sps", "additive", "no-dense"])
def test_seconds_curve_equals_step_seconds(model):
    for b, first, count in [(4, 0, 10), (3, 60, 80), (9, 120, 0), (1, 5000, 3)]:
        curve = model.seconds_curve(b, first, count)
        want = model.step_seconds(b, torch.arange(first, first + count))
        assert curve.dtype == np.float64 and curve.tolist() == want.tolist()
    with pytest.raises(ValueError, match="count must be an int >= 0, got -1"):
        model.seconds_curve(1, 0, -1)


def test_atomic_write_uses_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        path = atomic_write(tmp_path / "x.json", lambda p: p.write_text("{}"))
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644
