"""`StepsPerSecondTable`: the 1-D cost model, keyed on the verify rows M only (floor lookup)."""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from dspark.cost.base import (
    MAX_ROW_PROBE,
    CostModel,
    FitReport,
    ProfileSample,
    check_probes,
    check_samples,
    check_values,
    dense_lookup,
    dense_rows,
    floor_lookup,
    register_cost_model,
)


@register_cost_model
class StepsPerSecondTable(CostModel):
    """1-D table: steps/s measured at verify-row probes; T(B, M) = 1 / sps(floor probe <= M).

    Below the smallest probe the smallest probe's value is used (a step with fewer rows is taken to
    cost what the smallest measured step cost). B does not enter. Lookups read a dense per-row table
    built once per device (probes up to MAX_ROW_PROBE rows).
    """

    kind = "steps_per_second"

    def __init__(self, rows: Sequence[int], steps_per_second: Sequence[float], *, platform: str = "unknown",
                 width: int | None = None, fit_report: FitReport | None = None):
        super().__init__(platform=platform, width=width, fit_report=fit_report)
        self.rows = check_probes("rows", rows, 1, MAX_ROW_PROBE)
        self.steps_per_second = check_values("steps_per_second", steps_per_second, len(self.rows), True)
        # built here, not lazily: a lazy attribute's lock cannot be entered inside torch.compile
        self._dense_table = dense_rows(floor_lookup, self.rows, [1.0 / v for v in self.steps_per_second])

    def _dense_rows(self, num_requests: int) -> tuple[Tensor, float]:
        return self._dense_table, 0.0

    def _tables(self) -> tuple[Tensor, ...]:
        return (self._dense_table,)

    def _seconds(self, num_requests: int, rows: Tensor, tables: tuple[Tensor, ...]) -> Tensor:
        return dense_lookup(tables[0], rows)

    def _payload(self) -> dict[str, Any]:
        return {"rows": list(self.rows), "steps_per_second": list(self.steps_per_second)}

    @classmethod
    def _from_payload(cls, d: dict[str, Any], **common: Any) -> "StepsPerSecondTable":
        return cls(d["rows"], d["steps_per_second"], **common)

    @classmethod
    def fit(cls, samples: Sequence[ProfileSample], *, platform: str = "unknown",
            width: int | None = None) -> tuple["StepsPerSecondTable", FitReport]:
        """One probe per distinct M: steps/s = 1 / median(seconds) of the samples at that M."""
        samples = check_samples(samples)
        by_rows: dict[int, list[float]] = {}
        for s in samples:
            by_rows.setdefault(s.rows, []).append(s.seconds)
        probes = sorted(by_rows)
        medians = [float(torch.tensor(by_rows[m], dtype=torch.float64).median()) for m in probes]
        model = cls(probes, [1.0 / t for t in medians], platform=platform, width=width)
        report = FitReport.from_predictions([s.seconds for s in samples],
                                            [model.step_seconds(s.num_requests, s.rows) for s in samples])
        model.fit_report = report
        return model, report
