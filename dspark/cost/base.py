"""The cost-model contract: `CostModel` (predict, serialise, fingerprint), `ProfileSample`, `FitReport`, the
`kind` registry and JSON (de)serialisation (`dspark.cost.loading` loads any model and checks it against a run).

Every model serialises to JSON with a schema version, its `kind`, the platform it was profiled on and
optionally the static verify width W; `CostModel.load(path)` dispatches on `kind`. `fingerprint()`
hashes the canonical JSON so ranks can check they hold the same table.
"""
from __future__ import annotations

import abc
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

from dspark.util.fileio import atomic_write_text, load_json_as
from dspark.util.validate import check_type

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


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class ProfileSample:
    """One measured verify step: B requests, M total verify rows, wall seconds (median over repeats)."""

    num_requests: int
    rows: int
    seconds: float

    def __post_init__(self) -> None:
        if not is_int(self.num_requests) or self.num_requests < 1:
            raise ValueError(f"ProfileSample.num_requests must be an int >= 1, got {self.num_requests!r}")
        if not is_int(self.rows) or self.rows < self.num_requests:
            raise ValueError(
                f"ProfileSample.rows must be an int >= num_requests={self.num_requests} (every request "
                f"verifies its root), got {self.rows!r}"
            )
        if not is_real(self.seconds) or not math.isfinite(self.seconds) or self.seconds <= 0:
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
        if not is_int(d["num_samples"]) or d["num_samples"] < 0:
            raise ValueError(f"fit report num_samples must be an int >= 0, got {d['num_samples']!r}")
        return cls(residuals, rms, r2, d["num_samples"], dict(extras))


def check_samples(samples: Sequence[ProfileSample]) -> list[ProfileSample]:
    out = list(samples)
    if not out:
        raise ValueError("fit needs at least one ProfileSample, got none")
    for i, s in enumerate(out):
        if not isinstance(s, ProfileSample):
            raise TypeError(f"samples[{i}] must be a ProfileSample, got {type(s).__name__}: {s!r}")
    return out


def require_full_rank(x: Tensor, params: str, hint: str) -> int:
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
        if not is_int(p) or p < minimum or (maximum is not None and p > maximum):
            top = "" if maximum is None else f" and <= {maximum}"
            raise ValueError(f"{name}[{i}] must be an int >= {minimum}{top}, got {p!r}")
    for i in range(1, len(out)):
        if out[i] <= out[i - 1]:
            raise ValueError(f"{name} must be sorted and unique, got {name}[{i - 1}] = {out[i - 1]} "
                             f"then {name}[{i}] = {out[i]}")
    return out


def check_curve(term: object, probes: str, values: str, minimum: int, maximum: int | None = None) -> None:
    """Check a frozen term's probe points and its values, one per probe, in place (`check_probes`, `check_values`)."""
    checked = check_probes(probes, getattr(term, probes), minimum, maximum)
    object.__setattr__(term, probes, checked)
    object.__setattr__(term, values, check_values(values, getattr(term, values), len(checked), False))


def check_values(name: str, values: Sequence[object], length: int | None, positive: bool) -> tuple[float, ...]:
    """Finite reals (and > 0 when `positive`), with the expected length when given."""
    out = _sequence(name, values, "numbers")
    if length is not None and len(out) != length:
        raise ValueError(f"{name} must have one value per probe ({length}), got {len(out)}")
    for i, v in enumerate(out):
        if not is_real(v) or not math.isfinite(v) or (positive and v <= 0):
            need = "finite and > 0" if positive else "finite"
            raise ValueError(f"{name}[{i}] must be {need}, got {v!r}")
    return tuple(float(v) for v in out)


def check_scalar(name: str, value: object) -> float:
    """A finite real as a float; ValueError naming the field otherwise (a JSON `null` included)."""
    if not is_real(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class BatchTerm:
    """alpha(B) of a cost model: seconds `alpha[i]` at batch size `batch_probes[i]` (ints >= 1, strictly
    increasing; finite values, one per probe), read linearly between the probes, the end values held."""

    batch_probes: Sequence[int]
    alpha: Sequence[float]

    def __post_init__(self) -> None:
        check_curve(self, "batch_probes", "alpha", 1)


def set_bias_and_batch_term(model: CostModel, bias: float, batch_term: BatchTerm) -> None:
    """Check and set a per-row model's bias and alpha(B) (`bias`, `batch_probes`, `alpha`)."""
    model.bias = check_scalar("bias", bias)
    check_type("batch_term", batch_term, BatchTerm)
    model.batch_probes, model.alpha = batch_term.batch_probes, batch_term.alpha


def _rows_tensor(rows: Tensor | int) -> tuple[Tensor, bool]:
    if isinstance(rows, Tensor):
        if rows.dtype == torch.bool or rows.is_complex():
            raise TypeError(f"rows must be an integer or real tensor, got dtype {rows.dtype}")
        return rows.to(torch.float64), False
    if not is_int(rows):
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
        if width is not None and (not is_int(width) or width < 2):
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
        if not is_int(num_requests) or num_requests < 0:
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
            if not is_int(v) or v < lo:
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
        return load_json_as(path, cls.from_dict)

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
