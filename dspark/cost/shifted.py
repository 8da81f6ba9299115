"""`ShiftedCostModel`: another cost model plus a term that depends on B alone, `T = base(B, M) + shift(B)`.

A serving cost builds the T(B, M) a planner believes this way: the target's verify step plus the draft's
seconds at one depth and the KV read at one context, all functions of B (`ServingCost.believed`).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from dspark.cost.base import CostModel, check_probes, check_values, interp, register_cost_model


@register_cost_model
class ShiftedCostModel(CostModel):
    """T(B, M) = base.T(B, M) + shift(B), shift linearly interpolated between batch probes (end values held).

    base: any CostModel; batch_probes: B values, sorted and unique; shift: seconds at each probe (may be < 0, but
    T must stay > 0, which the caller's coverage check proves where it matters). Width and platform are base's.
    """

    kind = "shifted"

    def __init__(self, base: CostModel, batch_probes: Sequence[int], shift: Sequence[float], *,
                 platform: str | None = None, width: int | None = None, fit_report=None):
        if not isinstance(base, CostModel):
            raise TypeError(f"base must be a CostModel, got {type(base).__name__}")
        super().__init__(platform=platform or base.platform, width=width if width is not None else base.width,
                         fit_report=fit_report)
        self.base = base
        self.batch_probes = check_probes("batch_probes", batch_probes, 1)
        self.shift = check_values("shift", shift, len(self.batch_probes), False)

    def shift_at(self, num_requests: int) -> float:
        """shift(B), linearly interpolated between the batch probes (end values held)."""
        return float(np.interp(num_requests, self.batch_probes, self.shift))

    def _tables(self) -> tuple[Sequence[float], ...]:
        return self.batch_probes, self.shift

    def _seconds(self, num_requests: int, rows: Tensor, tables: tuple[Tensor, ...]) -> Tensor:
        probes, shift = tables
        b = torch.full((1,), float(num_requests), dtype=torch.float64, device=rows.device)
        return self.base.step_seconds(num_requests, rows) + interp(probes, shift, b)

    def _dense_rows(self, num_requests: int) -> tuple[Tensor, float] | None:
        dense = self.base._dense_rows(num_requests)
        return None if dense is None else (dense[0], dense[1] + self.shift_at(num_requests))

    def _payload(self) -> dict[str, Any]:
        return {"base": self.base.to_dict(), "batch_probes": list(self.batch_probes), "shift": list(self.shift)}

    @classmethod
    def _from_payload(cls, d: dict[str, Any], **common: Any) -> "ShiftedCostModel":
        common.pop("fit_report", None)
        return cls(CostModel.from_dict(d["base"]), d["batch_probes"], d["shift"], **common)

    @classmethod
    def fit(cls, samples, **kwargs):
        raise NotImplementedError("a shifted model is built from a base model and a batch term, not fitted")
