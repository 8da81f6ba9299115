"""ShiftedCostModel: another model plus a term in B alone, on every path (step_seconds, the dense budget curve,
JSON), against a brute-force reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.cost import AdditiveCostModel, BatchTerm, CostModel, RowTerm, TieredCostModel, TierTerm
from dspark.cost.shifted import ShiftedCostModel

pytestmark = pytest.mark.cpu_only(reason="cost models are host-side tables")


def _bases():
    return [AdditiveCostModel(2e-3, BatchTerm([1, 8, 64], [0.0, 1e-3, 5e-3]), RowTerm([1, 16, 256], [1e-4, 2e-3, 9e-3]),
                              width=4),
            TieredCostModel(1e-3, BatchTerm([1, 16], [0.0, 2e-3]), TierTerm([4, 8, 32, 128], [1e-3, 2e-3, 4e-3, 9e-3]),
                            width=4)]


@settings(max_examples=40, deadline=None)
@given(base=st.sampled_from([0, 1]), b=st.integers(1, 80), m=st.integers(1, 128),
       shift=st.lists(st.floats(0.0, 5e-3), min_size=3, max_size=3))
def test_shifted_is_the_base_plus_the_interpolated_batch_term_on_every_path(base, b, m, shift) -> None:
    model = _bases()[base]
    probes = [1, 10, 64]
    shifted = ShiftedCostModel(model, probes, shift)
    want = float(model.step_seconds(b, m)) + float(np.interp(b, probes, shift))
    assert shifted.step_seconds(b, m) == pytest.approx(want, rel=1e-12)
    rows = torch.arange(b, b + 5, dtype=torch.float64)
    dense = shifted.seconds_curve(b, b, 5)
    np.testing.assert_allclose(dense, shifted.step_seconds(b, rows).numpy(), rtol=1e-12)
    again = CostModel.from_dict(shifted.to_dict())
    assert isinstance(again, ShiftedCostModel) and again == shifted and again.width == model.width
    assert again.step_seconds(b, m) == pytest.approx(want, rel=1e-12)


def test_shifted_refuses_a_non_model_and_bad_probes_naming_them() -> None:
    with pytest.raises(TypeError, match="base must be a CostModel, got dict"):
        ShiftedCostModel({}, [1], [0.0])
    with pytest.raises(ValueError, match="batch_probes must be sorted and unique"):
        ShiftedCostModel(_bases()[0], [4, 2], [0.0, 0.0])
    with pytest.raises(ValueError, match="shift must have one value per probe"):
        ShiftedCostModel(_bases()[0], [1, 2], [0.0])
