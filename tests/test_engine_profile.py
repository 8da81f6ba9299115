import logging
import math

import pytest
import torch

from dspark.cost import AdditiveCostModel, ProfileSample, StepsPerSecondTable
from dspark.engine.profile import fit_cost_model

SAMPLES = [ProfileSample(b, m, 1e-3 * (1.0 + 0.5 * b + 0.25 * m)) for b in (1, 4, 16) for m in range(b, 8 * b + 1, b)]


def test_fit_cost_model_takes_the_finest_valid_additive_fit():
    model, report, row_bin = fit_cost_model(SAMPLES, gamma=7, platform="cpu")
    assert isinstance(model, AdditiveCostModel) and row_bin == 1
    assert report.rms < 1e-6


def test_fit_cost_model_falls_back_to_the_steps_table_with_a_warning(monkeypatch, caplog):
    def refuse(cls, samples, **kwargs):
        raise ValueError(f"predicts a non-positive step time at row_bin={kwargs.get('row_bin')}")

    monkeypatch.setattr(AdditiveCostModel, "fit", classmethod(refuse))
    with caplog.at_level(logging.WARNING):
        model, _, row_bin = fit_cost_model(SAMPLES, gamma=7, platform="cpu")
    assert isinstance(model, StepsPerSecondTable) and row_bin is None and model.width == 8
    assert "falling back to the 1-D steps/s table" in caplog.text and "row_bin=64" in caplog.text
    t = model.step_seconds(4, 20)
    assert math.isfinite(t) and t > 0
    assert model.step_seconds(16, 128) == pytest.approx(1e-3 * (1.0 + 0.5 * 16 + 0.25 * 128))


def test_monotone_in_rows_pools_dips_per_batch_size():
    from dspark.engine.profile import monotone_in_rows

    raw = [ProfileSample(1, 1, 5.0), ProfileSample(1, 2, 3.0), ProfileSample(1, 3, 4.0), ProfileSample(1, 4, 9.0),
           ProfileSample(4, 4, 2.0), ProfileSample(4, 8, 1.0)]
    out = {(s.num_requests, s.rows): s.seconds for s in monotone_in_rows(raw)}
    assert out == {(1, 1): 4.0, (1, 2): 4.0, (1, 3): 4.0, (1, 4): 9.0, (4, 4): 1.5, (4, 8): 1.5}
    gen = torch.Generator().manual_seed(0)
    noisy = [ProfileSample(b, m, float(m + 3 * torch.rand((), generator=gen))) for b in (2, 5) for m in range(b, 30)]
    fixed = monotone_in_rows(noisy)
    for b in (2, 5):
        vals = [s.seconds for s in sorted((s for s in fixed if s.num_requests == b), key=lambda s: s.rows)]
        assert all(x <= y for x, y in zip(vals, vals[1:]))  # non-decreasing in the rows
        assert sum(vals) == pytest.approx(sum(s.seconds for s in noisy if s.num_requests == b))  # pooling keeps sums
    assert monotone_in_rows(fixed) == fixed  # already monotone: unchanged
