"""`AdditiveCostModel`: `T = bias + alpha(B) + theta(M)`, linear interpolation between probes; fitted by
least squares over M binned to `row_bin`, optionally with theta(M) non-decreasing and convex."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from dspark.cost.base import (
    MAX_ROW_PROBE,
    BatchTerm,
    CostModel,
    FitReport,
    ProfileSample,
    check_curve,
    check_samples,
    dense_lookup,
    dense_rows,
    interp,
    is_int,
    register_cost_model,
    require_full_rank,
    set_bias_and_batch_term,
)
from dspark.cost.lsq import nonnegative_lstsq
from dspark.util.validate import check_type


def bin_rows(rows: int, row_bin: int) -> int:
    """round(M / row_bin) * row_bin with halves rounded up (the profiler's M binning)."""
    return ((2 * rows + row_bin) // (2 * row_bin)) * row_bin


def _confounded(batch_probes: Sequence[int], row_probes: Sequence[int]) -> str:
    return (f"batch probes {list(batch_probes)} and row bins {list(row_probes)} are confounded (add samples "
            "with other (B, M) pairs, e.g. off-diagonal)")


@dataclass(frozen=True)
class RowTerm:
    """theta(M) of `AdditiveCostModel`: seconds `theta[i]` at `row_probes[i]` verify rows (ints in
    [0, MAX_ROW_PROBE], strictly increasing; finite values, one per probe), read linearly between the probes,
    the end values held."""

    row_probes: Sequence[int]
    theta: Sequence[float]

    def __post_init__(self) -> None:
        check_curve(self, "row_probes", "theta", 0, MAX_ROW_PROBE)


@register_cost_model
class AdditiveCostModel(CostModel):
    """T(B, M) = bias + alpha(B) + theta(M), alpha and theta linearly interpolated between probes.

    Outside the probes the end values are held (clamped), so predictions never extrapolate a trend.
    theta is read from a dense per-row table built once per device (row probes up to MAX_ROW_PROBE).
    Validation requires the predicted step time to be positive at every probe pair, which makes it
    positive everywhere (interpolation stays within the probe values).

    Args:
        bias: seconds every step pays.
        batch_term: alpha(B) (`BatchTerm`); row_term: theta(M) (`RowTerm`). The model exposes their probes and
            values flat: `batch_probes`, `alpha`, `row_probes`, `theta`.
        platform / width / fit_report: as `CostModel`.
    """

    kind = "additive"

    def __init__(self, bias: float, batch_term: BatchTerm, row_term: RowTerm, *, platform: str = "unknown",
                 width: int | None = None, fit_report: FitReport | None = None):
        super().__init__(platform=platform, width=width, fit_report=fit_report)
        set_bias_and_batch_term(self, bias, batch_term)
        check_type("row_term", row_term, RowTerm)
        self.row_probes, self.theta = row_term.row_probes, row_term.theta
        low = self.bias + min(self.alpha) + min(self.theta)
        if not low > 0:
            raise ValueError(
                f"step time must be > 0 at every probe, but bias + min(alpha) + min(theta) = {low!r}"
            )
        self._dense_table = dense_rows(interp, self.row_probes, self.theta)  # eager: compiles without a lock

    def _dense_rows(self, num_requests: int) -> tuple[Tensor, float]:
        return self._dense_table, self.bias + self.alpha_at(num_requests)

    def _tables(self) -> tuple[Tensor, ...]:
        return (self._dense_table,)

    def alpha_at(self, num_requests: int) -> float:
        """alpha(B), linearly interpolated between batch probes (end values held)."""
        bp, a = self.batch_probes, self.alpha
        # bisect_right in plain Python: torch.compile cannot trace the C `bisect` module
        hi = min(max(sum(p <= num_requests for p in bp), 1), len(bp) - 1)
        if len(bp) == 1:
            return a[0]
        f = min(max((num_requests - bp[hi - 1]) / (bp[hi] - bp[hi - 1]), 0.0), 1.0)
        return a[hi - 1] + f * (a[hi] - a[hi - 1])

    def _seconds(self, num_requests: int, rows: Tensor, tables: tuple[Tensor, ...]) -> Tensor:
        return dense_lookup(tables[0], rows) + (self.bias + self.alpha_at(num_requests))

    def _payload(self) -> dict[str, Any]:
        return {"bias": self.bias, "batch_probes": list(self.batch_probes), "alpha": list(self.alpha),
                "row_probes": list(self.row_probes), "theta": list(self.theta)}

    @classmethod
    def _from_payload(cls, d: dict[str, Any], **common: Any) -> "AdditiveCostModel":
        return cls(d["bias"], BatchTerm(d["batch_probes"], d["alpha"]), RowTerm(d["row_probes"], d["theta"]), **common)

    @classmethod
    def fit(cls, samples: Sequence[ProfileSample], *, row_bin: int = 64, platform: str = "unknown",
            width: int | None = None, convex_rows: bool = False) -> tuple["AdditiveCostModel", FitReport]:
        """Least squares over one-hot B probes and M bins (round(M / row_bin) * row_bin).

        alpha and theta are pinned to 0 at their first probe (the rest is absorbed in bias). A design
        whose columns are linearly dependent (for example a diagonal static sweep where every B pairs
        with one M bin) is refused, with or without `convex_rows`: the split between alpha and theta
        would be arbitrary.

        convex_rows: constrain theta(M) to be non-decreasing and convex (the best such fit: non-negative
        weights on hinges max(0, M - m_j) at the row bins, `dspark.cost.lsq`). An eager step's cost is flat
        while the device is latency-bound, then grows with the rows: convex. With T convex in the rows and
        tau concave in the budget (survivals taken best-first), theta(b) = tau / T is unimodal, so the
        synchronous greedy scan (lag 0) stops at the global argmax instead of at a timing-noise dip.
        (Captured tiers make T a staircase: they have their own model, `TieredCostModel`.)
        """
        samples = check_samples(samples)
        if not is_int(row_bin) or row_bin < 1:
            raise ValueError(f"row_bin must be an int >= 1, got {row_bin!r}")
        if convex_rows:
            return cls._fit_convex(samples, row_bin, platform, width)
        bins = [bin_rows(s.rows, row_bin) for s in samples]
        batch_probes = sorted({s.num_requests for s in samples})
        row_probes = sorted(set(bins))
        bcol = {b: i for i, b in enumerate(batch_probes[1:])}
        mcol = {m: len(bcol) + i for i, m in enumerate(row_probes[1:])}
        num_params = 1 + len(bcol) + len(mcol)
        x = torch.zeros(len(samples), num_params, dtype=torch.float64)
        x[:, 0] = 1.0
        for i, (s, m) in enumerate(zip(samples, bins)):
            if s.num_requests in bcol:
                x[i, 1 + bcol[s.num_requests]] = 1.0
            if m in mcol:
                x[i, 1 + mcol[m]] = 1.0
        rank = require_full_rank(x, f"bias + {len(bcol)} batch + {len(mcol)} row-bin levels",
                                  _confounded(batch_probes, row_probes))
        y = torch.tensor([s.seconds for s in samples], dtype=torch.float64)
        coef = torch.linalg.lstsq(x, y.unsqueeze(1), driver="gelsd").solution.squeeze(1).tolist()
        alpha = [0.0] + coef[1:1 + len(bcol)]
        theta = [0.0] + coef[1 + len(bcol):]
        model = cls(coef[0], BatchTerm(batch_probes, alpha), RowTerm(row_probes, theta), platform=platform,
                    width=width)
        report = FitReport.from_predictions(
            y.tolist(), [model.step_seconds(s.num_requests, s.rows) for s in samples],
            extras={"row_bin": row_bin, "rank": rank},
        )
        model.fit_report = report
        return model, report

    @classmethod
    def _fit_convex(cls, samples: list[ProfileSample], row_bin: int, platform: str,
                    width: int | None) -> tuple["AdditiveCostModel", FitReport]:
        bins = [bin_rows(s.rows, row_bin) for s in samples]
        batch_probes = sorted({s.num_requests for s in samples})
        row_probes = sorted(set(bins))
        free = np.zeros((len(samples), len(batch_probes)))
        free[:, 0] = 1.0  # bias, then alpha(B) for every batch probe but the first
        for i, s in enumerate(samples):
            j = batch_probes.index(s.num_requests)
            if j:
                free[i, j] = 1.0
        knots = np.array(row_probes[:-1], dtype=np.float64)
        hinges = np.maximum(0.0, np.array(bins, dtype=np.float64)[:, None] - knots[None, :])
        design = np.concatenate([free, hinges], axis=1)
        rank = require_full_rank(torch.from_numpy(design),
                                  f"bias + {len(batch_probes) - 1} batch + {len(knots)} row-hinge levels",
                                  _confounded(batch_probes, row_probes))
        y = np.array([s.seconds for s in samples])
        coef = nonnegative_lstsq(design, y, free=free.shape[1])
        weights = coef[free.shape[1]:]
        theta = np.maximum(0.0, np.array(row_probes, dtype=np.float64)[:, None] - knots[None, :]) @ weights
        alpha = [0.0] + coef[1:free.shape[1]].tolist()
        model = cls(float(coef[0]), BatchTerm(batch_probes, alpha), RowTerm(row_probes, theta.tolist()),
                    platform=platform, width=width)
        report = FitReport.from_predictions(
            y.tolist(), [model.step_seconds(s.num_requests, s.rows) for s in samples],
            extras={"row_bin": row_bin, "convex_rows": True, "rank": rank},
        )
        model.fit_report = report
        return model, report
