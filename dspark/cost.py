"""Step-cost models T(B, M): predicted seconds of one verify step with B requests and M verify rows.

Three models live here (DESIGN.md 4.6); more plug in through `register_cost_model`:

- `StepsPerSecondTable`: 1-D, keyed on M only, floor lookup (the nearest probe <= M).
- `AdditiveCostModel`: `T = bias + alpha(B) + theta(M)`, linear interpolation between probes.
- `TieredCostModel`: `T = bias + alpha(B) + phi(tier(M))`, keyed on the graph tier the step replays.

Every model serialises to JSON with a schema version, its `kind`, the platform it was profiled on and
optionally the static verify width W; `load_cost_model(path)` dispatches on `kind`. `fingerprint()`
hashes the canonical JSON so ranks can check they hold the same table.
"""
from __future__ import annotations

import abc
import bisect
import functools
import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence

import numpy as np
import torch
from torch import Tensor

from dspark.fileio import atomic_write_text, read_json
from dspark.lsq import nonnegative_lstsq

SCHEMA_VERSION = 1

_REGISTRY: dict[str, type["CostModel"]] = {}


def register_cost_model(cls: type["CostModel"]) -> type["CostModel"]:
    """Class decorator: make `load_cost_model` / `CostModel.from_dict` know this model's `kind`."""
    if not isinstance(cls, type) or not issubclass(cls, CostModel):
        raise TypeError(f"register_cost_model takes a CostModel subclass, got {cls!r}")
    kind = getattr(cls, "kind", None)
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"{cls.__name__} must define a non-empty class attribute `kind`")
    if kind in _REGISTRY and _REGISTRY[kind] is not cls:
        raise ValueError(f"cost model kind {kind!r} is already registered by {_REGISTRY[kind].__name__}")
    _REGISTRY[kind] = cls
    return cls


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class ProfileSample:
    """One measured verify step: B requests, M total verify rows, wall seconds (median over repeats)."""

    num_requests: int
    rows: int
    seconds: float

    def __post_init__(self) -> None:
        if not _is_int(self.num_requests) or self.num_requests < 1:
            raise ValueError(f"ProfileSample.num_requests must be an int >= 1, got {self.num_requests!r}")
        if not _is_int(self.rows) or self.rows < self.num_requests:
            raise ValueError(
                f"ProfileSample.rows must be an int >= num_requests={self.num_requests} (every request "
                f"verifies its root), got {self.rows!r}"
            )
        if not _is_real(self.seconds) or not math.isfinite(self.seconds) or self.seconds <= 0:
            raise ValueError(f"ProfileSample.seconds must be finite and > 0, got {self.seconds!r}")


@dataclass(frozen=True)
class FitReport:
    """How well a fitted model reproduces its samples (residual = measured - predicted, in seconds).

    `extras` holds per-model diagnostics (for example the error at tier-2..tier+2), JSON-serialisable.
    """

    residuals: tuple[float, ...]
    rms: float
    r2: float
    num_samples: int
    extras: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_predictions(cls, measured: Sequence[float], predicted: Sequence[float],
                         extras: dict[str, Any] | None = None) -> "FitReport":
        """Residuals, RMS and R^2 (1 - SS_res / SS_tot; 1.0 for a perfect fit of constant data)."""
        y = torch.tensor(list(measured), dtype=torch.float64)
        res = y - torch.tensor(list(predicted), dtype=torch.float64)
        ss_res = float((res * res).sum())
        ss_tot = float(((y - y.mean()) ** 2).sum()) if y.numel() else 0.0
        if ss_tot > 0:
            r2 = 1.0 - ss_res / ss_tot
        else:
            r2 = 1.0 if ss_res == 0 else 0.0
        rms = math.sqrt(ss_res / y.numel()) if y.numel() else 0.0
        return cls(tuple(res.tolist()), rms, r2, int(y.numel()), dict(extras or {}))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["residuals"] = list(self.residuals)
        return d

    @classmethod
    def from_dict(cls, d: object) -> "FitReport":
        if not isinstance(d, dict):
            raise ValueError(f"fit report must be a JSON object, got {type(d).__name__}")
        missing = {"residuals", "rms", "r2", "num_samples"} - set(d)
        if missing:
            raise ValueError(f"fit report is missing {sorted(missing)}")
        extras = d.get("extras", {})
        if not isinstance(extras, dict):
            raise ValueError(f"fit report extras must be a JSON object, got {extras!r}")
        residuals = check_values("fit report residuals", d["residuals"], None, False)
        rms, r2 = (check_scalar(f"fit report {k}", d[k]) for k in ("rms", "r2"))
        if not _is_int(d["num_samples"]) or d["num_samples"] < 0:
            raise ValueError(f"fit report num_samples must be an int >= 0, got {d['num_samples']!r}")
        return cls(residuals, rms, r2, d["num_samples"], dict(extras))


def _check_samples(samples: Sequence[ProfileSample]) -> list[ProfileSample]:
    out = list(samples)
    if not out:
        raise ValueError("fit needs at least one ProfileSample, got none")
    for i, s in enumerate(out):
        if not isinstance(s, ProfileSample):
            raise TypeError(f"samples[{i}] must be a ProfileSample, got {type(s).__name__}: {s!r}")
    return out


def _require_full_rank(x: Tensor, params: str, hint: str) -> int:
    """The rank of the design matrix x [samples, parameters]; a fit that cannot identify every
    parameter (rank < columns) is refused: the split between the confounded terms would be arbitrary."""
    rank = int(torch.linalg.matrix_rank(x))
    if rank < x.shape[1]:
        raise ValueError(f"rank-deficient design: rank {rank} < {x.shape[1]} parameters ({params}) from "
                         f"{x.shape[0]} samples; {hint}")
    return rank


def _sequence(name: str, values: object, what: str) -> tuple:
    """A list / tuple / 1-D tensor or array as a tuple; ValueError naming the field otherwise (a JSON
    `null` or a scalar where a list belongs)."""
    if isinstance(values, (Tensor, np.ndarray)) and values.ndim == 1:
        return tuple(values.tolist())
    if not isinstance(values, (list, tuple, range)):
        raise ValueError(f"{name} must be a list of {what}, got {values!r}")
    return tuple(values)


def check_probes(name: str, probes: Sequence[object], minimum: int, maximum: int | None = None) -> tuple[int, ...]:
    """Probe points: non-empty, ints in [minimum, maximum], strictly increasing (sorted and unique)."""
    out = _sequence(name, probes, "ints")
    if not out:
        raise ValueError(f"{name} must not be empty")
    for i, p in enumerate(out):
        if not _is_int(p) or p < minimum or (maximum is not None and p > maximum):
            top = "" if maximum is None else f" and <= {maximum}"
            raise ValueError(f"{name}[{i}] must be an int >= {minimum}{top}, got {p!r}")
    for i in range(1, len(out)):
        if out[i] <= out[i - 1]:
            raise ValueError(f"{name} must be sorted and unique, got {name}[{i - 1}] = {out[i - 1]} "
                             f"then {name}[{i}] = {out[i]}")
    return out


def check_values(name: str, values: Sequence[object], length: int | None, positive: bool) -> tuple[float, ...]:
    """Finite reals (and > 0 when `positive`), with the expected length when given."""
    out = _sequence(name, values, "numbers")
    if length is not None and len(out) != length:
        raise ValueError(f"{name} must have one value per probe ({length}), got {len(out)}")
    for i, v in enumerate(out):
        if not _is_real(v) or not math.isfinite(v) or (positive and v <= 0):
            need = "finite and > 0" if positive else "finite"
            raise ValueError(f"{name}[{i}] must be {need}, got {v!r}")
    return tuple(float(v) for v in out)


def check_scalar(name: str, value: object) -> float:
    """A finite real as a float; ValueError naming the field otherwise (a JSON `null` included)."""
    if not _is_real(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _rows_tensor(rows: Tensor | int) -> tuple[Tensor, bool]:
    if isinstance(rows, Tensor):
        if rows.dtype == torch.bool or rows.is_complex():
            raise TypeError(f"rows must be an integer or real tensor, got dtype {rows.dtype}")
        return rows.to(torch.float64), False
    if not _is_int(rows):
        raise TypeError(f"rows must be an int or a tensor, got {rows!r} ({type(rows).__name__})")
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    return torch.tensor(float(rows), dtype=torch.float64), True


def floor_lookup(probes: Tensor, values: Tensor, x: Tensor) -> Tensor:
    """values[i] for the largest probe[i] <= x; below the first probe, values[0]."""
    idx = torch.searchsorted(probes, x.contiguous(), right=True) - 1
    return values.index_select(0, idx.clamp(min=0).reshape(-1)).reshape(x.shape)


def interp(probes: Tensor, values: Tensor, x: Tensor) -> Tensor:
    """Piecewise-linear interpolation; outside the probes the end values are held (clamped)."""
    if probes.numel() == 1:
        return values[0].expand(x.shape).clone()
    hi = torch.searchsorted(probes, x.contiguous(), right=True).clamp(1, probes.numel() - 1).reshape(-1)
    x0, x1 = probes.index_select(0, hi - 1), probes.index_select(0, hi)
    y0, y1 = values.index_select(0, hi - 1), values.index_select(0, hi)
    t = ((x.reshape(-1) - x0) / (x1 - x0)).clamp(0.0, 1.0)
    return (y0 + t * (y1 - y0)).reshape(x.shape)


MAX_ROW_PROBE = 1 << 20  # dense per-row tables stay below 8 MiB


def dense_rows(lookup, probes: Sequence[int], values: Sequence[float]) -> Tensor:
    """`lookup(probes, values, M)` evaluated once at every M in [0, probes[-1]] (float64 [probes[-1] + 1])."""
    p = torch.tensor(probes, dtype=torch.float64)
    return lookup(p, torch.tensor(values, dtype=torch.float64), torch.arange(probes[-1] + 1, dtype=torch.float64))


def dense_lookup(table: Tensor, rows: Tensor) -> Tensor:
    """table[M] for every row count (held at the last entry past the end): one gather, no search."""
    return torch.take(table, rows.to(torch.int64).clamp_(0, table.numel() - 1))


class CostModel(abc.ABC):
    """Predicted verify-step seconds T(B, M). Subclasses set `kind` and register themselves."""

    kind: ClassVar[str] = ""

    def __init__(self, *, platform: str = "unknown", width: int | None = None,
                 fit_report: FitReport | None = None):
        if not isinstance(platform, str) or not platform:
            raise ValueError(f"platform must be a non-empty string, got {platform!r}")
        if width is not None and (not _is_int(width) or width < 2):
            raise ValueError(f"width (W = gamma + 1) must be an int >= 2 or None, got {width!r}")
        if fit_report is not None and not isinstance(fit_report, FitReport):
            raise TypeError(f"fit_report must be a FitReport or None, got {type(fit_report).__name__}")
        self.platform = platform
        self.width = width
        self.fit_report = fit_report
        self._cache: dict[torch.device, tuple[Tensor, ...]] = {}

    # -- model-specific parts ------------------------------------------------------------------------
    @abc.abstractmethod
    def _tables(self) -> tuple[Sequence[float] | Tensor, ...]:
        """The numeric tables `_seconds` reads, in a fixed order (cached as float64 per device)."""

    @abc.abstractmethod
    def _seconds(self, num_requests: int, rows: Tensor, tables: tuple[Tensor, ...]) -> Tensor:
        """Seconds for float64 `rows` (any shape) with the cached tables on rows' device."""

    @abc.abstractmethod
    def _payload(self) -> dict[str, Any]:
        """The model-specific JSON fields."""

    @classmethod
    @abc.abstractmethod
    def _from_payload(cls, d: dict[str, Any], **common: Any) -> "CostModel":
        """Rebuild from JSON fields; `common` holds platform, width and fit_report."""

    @classmethod
    @abc.abstractmethod
    def fit(cls, samples: Sequence[ProfileSample], **kwargs: Any) -> tuple["CostModel", FitReport]:
        """Fit the model to measured samples; returns the model (carrying its report) and the report."""

    # -- shared machinery ----------------------------------------------------------------------------
    def step_seconds(self, num_requests: int, rows: Tensor | int) -> Tensor | float:
        """Predicted seconds for B = num_requests and M = rows (an int -> float, a tensor -> float64 tensor)."""
        if not _is_int(num_requests) or num_requests < 0:
            raise ValueError(f"num_requests must be an int >= 0, got {num_requests!r}")
        x, scalar = _rows_tensor(rows)
        tables = self._cache.get(x.device)
        if tables is None:
            tables = tuple(torch.as_tensor(t, dtype=torch.float64, device=x.device) for t in self._tables())
            self._cache[x.device] = tables
        out = self._seconds(num_requests, x, tables)
        return float(out) if scalar else out

    def _dense_rows(self, num_requests: int) -> tuple[Tensor, float] | None:
        """Optional hook: (seconds per row count M = 0..top on the CPU, offset added for this B)."""
        return None

    def seconds_curve(self, num_requests: int, first_rows: int, count: int) -> np.ndarray:
        """float64 host seconds for rows = first_rows .. first_rows + count - 1: the budget's whole curve.

        Equal to `step_seconds` on those rows; models with a dense per-row table answer with one numpy
        gather instead of a chain of torch ops.
        """
        for name, v, lo in (("num_requests", num_requests, 0), ("first_rows", first_rows, 0), ("count", count, 0)):
            if not _is_int(v) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        dense = self._dense_rows(num_requests)
        if dense is None:
            rows = torch.arange(first_rows, first_rows + count, dtype=torch.float64)
            return self.step_seconds(num_requests, rows).cpu().numpy()
        table, offset = dense
        host = table.numpy()
        return host[np.minimum(np.arange(first_rows, first_rows + count), host.size - 1)] + offset

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "kind": self.kind,
                             "platform": self.platform, "width": self.width}
        d.update(self._payload())
        if self.fit_report is not None:
            d["fit"] = self.fit_report.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: object) -> "CostModel":
        """Validate and rebuild; on the base class, dispatch on `kind` through the registry."""
        if not isinstance(d, dict):
            raise ValueError(f"a cost model must be a JSON object, got {type(d).__name__}")
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"schema_version must be {SCHEMA_VERSION}, got {version!r}")
        kind = d.get("kind")
        target = _REGISTRY.get(kind) if isinstance(kind, str) else None
        if target is None:
            raise ValueError(f"unknown cost model kind {kind!r}; known kinds: {sorted(_REGISTRY)}")
        if cls is not CostModel and target is not cls:
            raise ValueError(f"expected kind {cls.kind!r} for {cls.__name__}, got {kind!r}")
        fit = d.get("fit")
        common = {"platform": d.get("platform", "unknown"), "width": d.get("width"),
                  "fit_report": None if fit is None else FitReport.from_dict(fit)}
        try:
            return target._from_payload(d, **common)
        except KeyError as e:
            raise ValueError(f"{kind} cost model is missing field {e.args[0]!r}") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write the JSON atomically (temp file in the same folder, then rename)."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CostModel":
        """Read and validate a saved model; every error names the file and what is wrong."""
        d = read_json(path)
        try:
            return cls.from_dict(d)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON: equal on every rank that holds the same table."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CostModel) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(platform={self.platform!r}, width={self.width!r}, fingerprint={self.fingerprint()[:12]})"


def load_cost_model(path: str | os.PathLike) -> CostModel:
    """Load any registered cost model from JSON, dispatching on its `kind`."""
    return CostModel.load(path)


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

    @functools.cached_property
    def _dense_table(self) -> Tensor:
        return dense_rows(floor_lookup, self.rows, [1.0 / v for v in self.steps_per_second])

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
        samples = _check_samples(samples)
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


def bin_rows(rows: int, row_bin: int) -> int:
    """round(M / row_bin) * row_bin with halves rounded up (the profiler's M binning)."""
    return ((2 * rows + row_bin) // (2 * row_bin)) * row_bin


def _confounded(batch_probes: Sequence[int], row_probes: Sequence[int]) -> str:
    return (f"batch probes {list(batch_probes)} and row bins {list(row_probes)} are confounded (add samples "
            "with other (B, M) pairs, e.g. off-diagonal)")


@register_cost_model
class AdditiveCostModel(CostModel):
    """T(B, M) = bias + alpha(B) + theta(M), alpha and theta linearly interpolated between probes.

    Outside the probes the end values are held (clamped), so predictions never extrapolate a trend.
    theta is read from a dense per-row table built once per device (row probes up to MAX_ROW_PROBE).
    Validation requires the predicted step time to be positive at every probe pair, which makes it
    positive everywhere (interpolation stays within the probe values).
    """

    kind = "additive"

    def __init__(self, bias: float, batch_probes: Sequence[int], alpha: Sequence[float],
                 row_probes: Sequence[int], theta: Sequence[float], *, platform: str = "unknown",
                 width: int | None = None, fit_report: FitReport | None = None):
        super().__init__(platform=platform, width=width, fit_report=fit_report)
        self.bias = check_scalar("bias", bias)
        self.batch_probes = check_probes("batch_probes", batch_probes, 1)
        self.alpha = check_values("alpha", alpha, len(self.batch_probes), False)
        self.row_probes = check_probes("row_probes", row_probes, 0, MAX_ROW_PROBE)
        self.theta = check_values("theta", theta, len(self.row_probes), False)
        low = self.bias + min(self.alpha) + min(self.theta)
        if not low > 0:
            raise ValueError(
                f"step time must be > 0 at every probe, but bias + min(alpha) + min(theta) = {low!r}"
            )

    @functools.cached_property
    def _dense_table(self) -> Tensor:
        return dense_rows(interp, self.row_probes, self.theta)

    def _dense_rows(self, num_requests: int) -> tuple[Tensor, float]:
        return self._dense_table, self.bias + self.alpha_at(num_requests)

    def _tables(self) -> tuple[Tensor, ...]:
        return (self._dense_table,)

    def alpha_at(self, num_requests: int) -> float:
        """alpha(B), linearly interpolated between batch probes (end values held)."""
        bp, a = self.batch_probes, self.alpha
        hi = min(max(bisect.bisect_right(bp, num_requests), 1), len(bp) - 1)
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
        return cls(d["bias"], d["batch_probes"], d["alpha"], d["row_probes"], d["theta"], **common)

    @classmethod
    def fit(cls, samples: Sequence[ProfileSample], *, row_bin: int = 64, platform: str = "unknown",
            width: int | None = None, convex_rows: bool = False) -> tuple["AdditiveCostModel", FitReport]:
        """Least squares over one-hot B probes and M bins (round(M / row_bin) * row_bin).

        alpha and theta are pinned to 0 at their first probe (the rest is absorbed in bias). A design
        whose columns are linearly dependent (for example a diagonal static sweep where every B pairs
        with one M bin) is refused, with or without `convex_rows`: the split between alpha and theta
        would be arbitrary.

        convex_rows: constrain theta(M) to be non-decreasing and convex (the best such fit: non-negative
        weights on hinges max(0, M - m_j) at the row bins, `dspark.lsq`). An eager step's cost is flat
        while the device is latency-bound, then grows with the rows: convex. With T convex in the rows and
        tau concave in the budget (survivals taken best-first), theta(b) = tau / T is unimodal, so the
        synchronous greedy scan (lag 0) stops at the global argmax instead of at a timing-noise dip.
        (Captured tiers make T a staircase: they have their own model, `TieredCostModel`.)
        """
        samples = _check_samples(samples)
        if not _is_int(row_bin) or row_bin < 1:
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
        rank = _require_full_rank(x, f"bias + {len(bcol)} batch + {len(mcol)} row-bin levels",
                                  _confounded(batch_probes, row_probes))
        y = torch.tensor([s.seconds for s in samples], dtype=torch.float64)
        coef = torch.linalg.lstsq(x, y.unsqueeze(1), driver="gelsd").solution.squeeze(1).tolist()
        alpha = [0.0] + coef[1:1 + len(bcol)]
        theta = [0.0] + coef[1 + len(bcol):]
        model = cls(coef[0], batch_probes, alpha, row_probes, theta, platform=platform, width=width)
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
        rank = _require_full_rank(torch.from_numpy(design),
                                  f"bias + {len(batch_probes) - 1} batch + {len(knots)} row-hinge levels",
                                  _confounded(batch_probes, row_probes))
        y = np.array([s.seconds for s in samples])
        coef = nonnegative_lstsq(design, y, free=free.shape[1])
        weights = coef[free.shape[1]:]
        theta = np.maximum(0.0, np.array(row_probes, dtype=np.float64)[:, None] - knots[None, :]) @ weights
        alpha = [0.0] + coef[1:free.shape[1]].tolist()
        model = cls(float(coef[0]), batch_probes, alpha, row_probes, theta.tolist(), platform=platform,
                    width=width)
        report = FitReport.from_predictions(
            y.tolist(), [model.step_seconds(s.num_requests, s.rows) for s in samples],
            extras={"row_bin": row_bin, "convex_rows": True, "rank": rank},
        )
        model.fit_report = report
        return model, report


def tier_index(rows: Tensor, tiers: Tensor) -> Tensor:
    """Index of the smallest tier >= rows (len(tiers) past the largest): `dspark.layout.round_up_to_tier`."""
    return torch.searchsorted(tiers, rows.contiguous(), right=False)


def tier_edge_errors(model: CostModel, samples: Sequence[ProfileSample], tiers: Sequence[int],
                     offsets: Sequence[int] = (-2, -1, 0, 1, 2)) -> dict[str, dict[str, float]]:
    """Relative error (predicted / measured - 1) at each tier + offset, averaged over the samples there.

    Keys are str(tier) -> str(offset); points without samples, and rows past the largest tier (eager
    steps), are left out. This is where a smooth fit across a tier cliff is most wrong.
    """
    out: dict[str, dict[str, float]] = {}
    for t in tiers:
        for d in offsets:
            at = [s for s in samples if s.rows == t + d <= tiers[-1]]
            if at:
                err = [float(model.step_seconds(s.num_requests, s.rows)) / s.seconds - 1.0 for s in at]
                out.setdefault(str(t), {})[str(d)] = sum(err) / len(err)
    return out


def platform_device_type(platform: str) -> str:
    """The device type a platform string names: its last `-`-separated part ("x86_64-cuda" -> "cuda")."""
    return platform.rsplit("-", 1)[-1]


def check_cost_model(model: object, *, width: int | None = None, platform: str | None = None) -> CostModel:
    """The one rule where a cost model meets a run: the model's W must be the run's W = gamma + 1, and the
    device type of its platform (`platform_device_type`) the run's. A model that records no W (None) or
    no platform ("unknown") is accepted for any. ValueError naming both sides and what to re-profile."""
    if not isinstance(model, CostModel):
        raise TypeError(f"cost_model must be a CostModel, got {type(model).__name__}: {model!r}")
    if width is not None and model.width is not None and model.width != width:
        raise ValueError(f"cost model {model.kind!r} was profiled for W={model.width}, this run has W={width} "
                         f"(gamma={width - 1}): re-profile the verify step at gamma={width - 1} "
                         f"(perf/tier_sweep.py) or run with gamma={model.width - 1}")
    if (platform is not None and model.platform != "unknown"
            and platform_device_type(model.platform) != platform_device_type(platform)):
        raise ValueError(f"cost model {model.kind!r} was profiled on platform {model.platform!r}, this run is on "
                         f"{platform!r}: re-profile the verify step on this platform (perf/tier_sweep.py) or "
                         "load the table profiled for it")
    return model


def _components(pairs: Sequence[tuple[int, int]]) -> list[tuple[list[int], list[int]]]:
    """Connected components of the bipartite graph B-level <-> tier-level joined by the samples."""
    parent: dict[tuple[str, int], tuple[str, int]] = {}

    def find(x: tuple[str, int]) -> tuple[str, int]:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for b, t in pairs:
        parent[find(("B", b))] = find(("tier", t))
    groups: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
    for node in sorted(parent):
        bs, ts = groups.setdefault(find(node), ([], []))
        (bs if node[0] == "B" else ts).append(node[1])
    return list(groups.values())


@register_cost_model
class TieredCostModel(CostModel):
    """Cost keyed on the tier the step replays: T(B, M) = bias + alpha(B) + phi(tier(M)).

    tier(M) is the smallest captured tier >= M, the same round-up the runtime uses, so the model is a
    staircase: one value per tier, constant inside it. The budget argmax (`choose_budget`) therefore
    lands on a tier top (the most rows the paid tier holds) or on the last candidate: the budget
    decision and the tier fill are one decision. alpha(B) is interpolated linearly between batch probes
    (held outside them). With `table` ([batch probe][tier] seconds) the dense table replaces
    bias + alpha + phi (still linear in B per tier). Past the largest tier the step would run eager:
    the model predicts +inf there, so the planner never chooses to leave the captured tiers.
    """

    kind = "tiered"

    def __init__(self, bias: float, batch_probes: Sequence[int], alpha: Sequence[float], tiers: Sequence[int],
                 phi: Sequence[float], *, table: Sequence[Sequence[float]] | None = None,
                 platform: str = "unknown", width: int | None = None, fit_report: FitReport | None = None):
        super().__init__(platform=platform, width=width, fit_report=fit_report)
        self.bias = check_scalar("bias", bias)
        self.batch_probes = check_probes("batch_probes", batch_probes, 1)
        self.alpha = check_values("alpha", alpha, len(self.batch_probes), False)
        self.tiers = check_probes("tiers", tiers, 1)
        self.phi = check_values("phi", phi, len(self.tiers), False)
        self.table: tuple[tuple[float, ...], ...] | None = None
        grid = [[self.bias + a + p for p in self.phi] for a in self.alpha]
        if table is not None:
            rows = list(table)
            if len(rows) != len(self.batch_probes):
                raise ValueError(f"table needs one row per batch probe ({len(self.batch_probes)}), got {len(rows)}")
            self.table = tuple(check_values(f"table[{i}]", r, len(self.tiers), False) for i, r in enumerate(rows))
            grid = [list(r) for r in self.table]
        _check_reachable_positive(self.batch_probes, self.tiers, grid, self.width)

    def _tables(self) -> tuple[Sequence[float], ...]:
        dense = [v for r in self.table for v in r] if self.table is not None else []
        return self.batch_probes, self.alpha, self.tiers, self.phi, dense

    def _seconds(self, num_requests: int, rows: Tensor, tables: tuple[Tensor, ...]) -> Tensor:
        bp, alpha, tiers, phi, dense = tables
        idx = tier_index(rows, tiers)
        b = torch.full((1,), float(num_requests), dtype=torch.float64, device=rows.device)
        if self.table is None:
            per_tier = self.bias + interp(bp, alpha, b) + phi
        else:
            grid = dense.reshape(bp.numel(), tiers.numel())
            per_tier = torch.stack([interp(bp, grid[:, j], b) for j in range(tiers.numel())]).reshape(-1)
        inf = torch.full((1,), torch.inf, dtype=torch.float64, device=rows.device)
        return torch.cat([per_tier, inf]).index_select(0, idx.reshape(-1)).reshape(rows.shape)

    def tier_of(self, rows: int) -> int | None:
        """The tier a step with this many rows replays (None past the largest)."""
        idx = int(tier_index(torch.tensor([float(rows)], dtype=torch.float64),
                             torch.tensor(self.tiers, dtype=torch.float64)))
        return self.tiers[idx] if idx < len(self.tiers) else None

    def _payload(self) -> dict[str, Any]:
        d: dict[str, Any] = {"bias": self.bias, "batch_probes": list(self.batch_probes), "alpha": list(self.alpha),
                             "tiers": list(self.tiers), "phi": list(self.phi)}
        if self.table is not None:
            d["table"] = [list(r) for r in self.table]
        return d

    @classmethod
    def _from_payload(cls, d: dict[str, Any], **common: Any) -> "TieredCostModel":
        return cls(d["bias"], d["batch_probes"], d["alpha"], d["tiers"], d["phi"], table=d.get("table"), **common)

    @classmethod
    def fit(cls, samples: Sequence[ProfileSample], *, tiers: Sequence[int], dense: bool = False,
            platform: str = "unknown", width: int | None = None) -> tuple["TieredCostModel", FitReport]:
        """Least squares over one-hot batch probes and tiers (each sample at the tier its rows replay).

        Every tier needs samples, none may lie past the largest tier, and the design must be connected
        (every batch probe linked to every tier through shared samples) and of full rank; otherwise the
        split between alpha and phi is arbitrary and the fit is refused. dense=True also stores the
        median of every measured (batch probe, tier) cell as the lookup table (others: the additive value).
        The report's extras hold the relative error at tier-2 .. tier+2 (`tier_edge_error`).
        """
        samples = _check_samples(samples)
        tiers = check_probes("tiers", tiers, 1)
        tier_t = torch.tensor(tiers, dtype=torch.float64)
        idx = tier_index(torch.tensor([float(s.rows) for s in samples], dtype=torch.float64), tier_t).tolist()
        beyond = sorted({s.rows for s, i in zip(samples, idx) if i == len(tiers)})
        if beyond:
            raise ValueError(f"samples with rows {beyond} lie past the largest tier {tiers[-1]} (eager steps); "
                             "drop them or capture a larger tier")
        pairs = [(s.num_requests, tiers[i]) for s, i in zip(samples, idx)]
        missing = sorted(set(tiers) - {t for _, t in pairs})
        if missing:
            raise ValueError(f"tiers {missing} have no samples; the model needs one measured value per tier")
        comps = _components(pairs)
        if len(comps) > 1:
            desc = "; ".join(f"B {bs} only with tiers {ts}" for bs, ts in comps)
            raise ValueError(f"disconnected design ({len(comps)} groups: {desc}): alpha(B) and phi(tier) "
                             "cannot be separated; add samples that link the groups")
        batch_probes = sorted({b for b, _ in pairs})
        bcol = {b: 1 + i for i, b in enumerate(batch_probes[1:])}
        tcol = {t: len(bcol) + i for i, t in enumerate(tiers[1:], start=1)}
        x = torch.zeros(len(samples), 1 + len(bcol) + len(tcol), dtype=torch.float64)
        x[:, 0] = 1.0
        for i, (b, t) in enumerate(pairs):
            if b in bcol:
                x[i, bcol[b]] = 1.0
            if t in tcol:
                x[i, tcol[t]] = 1.0
        rank = _require_full_rank(x, f"bias + {len(bcol)} batch + {len(tcol)} tier levels",
                                  "add samples that pair each batch probe with more tiers")
        y = torch.tensor([s.seconds for s in samples], dtype=torch.float64)
        coef = torch.linalg.lstsq(x, y.unsqueeze(1), driver="gelsd").solution.squeeze(1).tolist()
        alpha = [0.0] + coef[1:1 + len(bcol)]
        phi = [0.0] + coef[1 + len(bcol):]
        model = cls(coef[0], batch_probes, alpha, tiers, phi, platform=platform, width=width)
        if dense:
            model = cls(coef[0], batch_probes, alpha, tiers, phi, table=_cell_medians(model, samples, pairs),
                        platform=platform, width=width)
        report = FitReport.from_predictions(
            y.tolist(), [model.step_seconds(s.num_requests, s.rows) for s in samples],
            extras={"rank": rank, "dense": dense, "tier_edge_error": tier_edge_errors(model, samples, tiers)},
        )
        model.fit_report = report
        return model, report


def _check_reachable_positive(batch_probes: Sequence[int], tiers: Sequence[int],
                              grid: Sequence[Sequence[float]], width: int | None) -> None:
    """Step time must be > 0 wherever a step can land. B requests verify B .. B*W rows, so they replay
    tier t only if t >= B and the tier below t is < B*W. Probe i serves every B in its interpolation
    interval (the neighbouring probes; the end probes also serve every B beyond them), so it matters at
    the tiers some B of that interval can replay. A fit may leave unreachable corners <= 0."""
    for i, b in enumerate(batch_probes):
        lo = batch_probes[i - 1] + 1 if i else 1
        hi = batch_probes[i + 1] * width if width is not None and i + 1 < len(batch_probes) else None
        for j, (t, v) in enumerate(zip(tiers, grid[i])):
            below = tiers[j - 1] if j else 0
            if t >= lo and (hi is None or below < hi) and not v > 0:
                raise ValueError(f"predicted step time at B={b}, tier {t} is {v!r}; it must be > 0 wherever "
                                 f"a step can land (tier >= B, tier below < B*W)")


def _cell_medians(model: TieredCostModel, samples: Sequence[ProfileSample],
                  pairs: Sequence[tuple[int, int]]) -> list[list[float]]:
    """Median seconds of each measured (batch probe, tier) cell; cells never measured (for example a
    tier below B's floor rows) take the additive prediction bias + alpha(B) + phi(tier)."""
    cells: dict[tuple[int, int], list[float]] = {}
    for s, key in zip(samples, pairs):
        cells.setdefault(key, []).append(s.seconds)
    return [[float(torch.tensor(cells[(b, t)], dtype=torch.float64).median()) if (b, t) in cells
             else float(model.step_seconds(b, t)) for t in model.tiers] for b in model.batch_probes]
