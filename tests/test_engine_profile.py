import logging
import math

import pytest

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
