"""STS fitting: per-position temperatures for the survival, and the `Calibration` JSON that carries them.

`fit_sts` fits `T_0, T_1, ...` left to right on the *cumulative* event (the accepted prefix reaches draft
k), keeping the survival of the already fitted positions fixed, with the planner's own formula and
rounding (`dspark.plan.survival.confidence_host` at float32 T, float32 products: the survival it scores
is `calibrated_survival`'s, bit for bit). The objective is the
design note's ECE grid search (`method="ece"`) or a proper score (`"nll"` default, `"brier"`) minimized by
a log-spaced grid then golden-section search on log T inside `bounds`. Requests are split into train and
held-out sets by request id; every metric in the report is measured on the held-out requests, before
(T = 1) and after, with cluster-bootstrap intervals over requests. One fit covers one acceptance policy.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from dspark.calibration.confidence import check_prefix_mask
from dspark.calibration.evaluate import Progress, evaluate
from dspark.calibration.metrics import (
    Sample,
    check_num_bins,
    metric_functions,
    occupied_bins,
)
from dspark.calibration.recorder import POLICIES, StsData
from dspark.plan.survival import check_temperatures, confidence_host
from dspark.util.fileio import atomic_write_text
from dspark.util.validate import check_int, check_path, check_real, check_tensor, check_type

SCHEMA = "dspark.calibration/1"
METHODS = ("nll", "brier", "ece")
GRID_POINTS = 81
GOLDEN_ITERS = 60
BOUND_TOL = 1.0e-3  # |log T - log bound| below this flags the temperature as stuck at the bound



def _json_clean(x: object) -> object:
    """NaN/inf -> None so the file is strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_clean(v) for v in x]
    return x


@dataclass
class Calibration:
    """Fitted STS temperatures for one acceptance policy, with the data summary and held-out metrics."""

    temperatures: list[float]
    gamma: int
    policy: str
    method: str
    data: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    schema: str = SCHEMA

    def __post_init__(self) -> None:
        if self.schema != SCHEMA:
            raise ValueError(f"calibration schema must be {SCHEMA!r}, got {self.schema!r}")
        check_int("gamma", self.gamma, 1)
        if not isinstance(self.temperatures, (list, tuple)) or not all(
                isinstance(t, (int, float)) and not isinstance(t, bool) for t in self.temperatures):
            raise ValueError(f"temperatures must be a list of numbers, got {self.temperatures!r}")
        self.temperatures = check_temperatures(list(map(float, self.temperatures)), self.gamma).tolist()
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        for name in ("data", "metrics"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a dict, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.warnings, list) or not all(isinstance(w, str) for w in self.warnings):
            raise ValueError(f"warnings must be a list of strings, got {self.warnings!r}")

    def temperatures_tensor(self, device: torch.device | str = "cpu") -> Tensor:
        """Temperatures as a float32 [gamma] tensor, ready for `calibrated_survival`."""
        return torch.tensor(self.temperatures, dtype=torch.float32, device=device)

    def save(self, path: str | os.PathLike) -> None:
        """Write strict JSON atomically (temporary file + rename)."""
        atomic_write_text(path, json.dumps(_json_clean(asdict(self)), indent=1, allow_nan=False) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        """Read and validate a calibration file (schema, gamma, temperatures, policy)."""
        try:
            obj = json.loads(check_path("path", path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a readable calibration JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: calibration JSON must be an object, got {type(obj).__name__}")
        known = set(cls.__dataclass_fields__)
        extra, missing = sorted(set(obj) - known), sorted({"temperatures", "gamma", "policy", "method"} - set(obj))
        if extra or missing:
            raise ValueError(f"{path}: calibration JSON has unknown keys {extra} / lacks keys {missing}")
        try:
            return cls(**obj)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _served(log_t: float) -> np.float32:
    """The temperature exp(log T) as the planner serves it: rounded to float32 (`check_temperatures`)."""
    return np.float32(math.exp(log_t))


def _argmin_1d(f: Callable[[float], float], lo: float, hi: float, refine: bool) -> float:
    """Minimize f over log T in [lo, hi]: log grid (ties -> closest to T = 1), then golden section."""
    grid = np.linspace(lo, hi, GRID_POINTS)
    vals = np.array([f(x) for x in grid])
    best = int(np.lexsort((np.abs(grid), vals))[0])
    if not refine:
        return float(grid[best])
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, GRID_POINTS - 1)]
    g = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(GOLDEN_ITERS):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    x = (a + b) / 2.0
    return x if f(x) <= vals[best] else float(grid[best])


@dataclass(frozen=True)
class PositionFit:
    """One position's fit: temperature, rows used, the objective there, bound flag, the ECE-collapse diagnosis.

    `score` is the objective at `temperature` on the observed training rows, computed from the survival
    the planner serves for these temperatures (`calibrated_survival`), bit for bit; NaN without rows.
    """

    position: int
    temperature: float
    rows: int
    score: float
    at_bound: bool
    occupied_bins_before: int
    occupied_bins_after: int

    @property
    def collapsed(self) -> bool:
        """The fit squeezed predictions that spread over several ECE bins into a single one."""
        return self.occupied_bins_after <= 1 < self.occupied_bins_before


def check_fit_options(*, method: str = "nll", bounds: tuple[float, float] = (0.05, 20.0), num_bins: int = 15,
                      holdout_fraction: float = 0.25, bootstrap: int = 0, level: float = 0.95, seed: int = 0) -> None:
    """Validate `fit_sts`'s options (ValueError naming the option and the value): callers check them before
    loading any data, so a bad option fails in a second, not after the shards are read."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if (not isinstance(bounds, (tuple, list)) or len(bounds) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)
            or not (math.isfinite(bounds[0]) and math.isfinite(bounds[1]) and 0.0 < bounds[0] < bounds[1])):
        raise ValueError(f"bounds must be finite with 0 < low < high, got {bounds!r}")
    check_num_bins(num_bins)
    check_real("holdout_fraction", holdout_fraction, 0.0, 1.0, low_open=True, high_open=True)
    check_int("bootstrap", bootstrap, 0)
    check_real("level", level, 0.0, 1.0, low_open=True, high_open=True)
    check_int("seed", seed, 0)


@dataclass(frozen=True)
class FitOptions:
    """How `fit_sts` fits and reports, checked when built (`check_fit_options`).

    method: the per-position objective (`METHODS`); bounds: the temperature search interval (0 < low < high);
    num_bins: ECE bins; holdout_fraction: the share of request ids held out for the report; bootstrap / level:
    resamples and level of its intervals; seed: the held-out split and the bootstrap draws.
    """

    method: str = "nll"
    bounds: tuple[float, float] = (0.05, 20.0)
    num_bins: int = 15
    holdout_fraction: float = 0.25
    bootstrap: int = 200
    level: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        check_fit_options(**asdict(self))


def fit_temperatures(logits: Tensor, labels: Tensor, *, method: str = "nll",
                     bounds: tuple[float, float] = (0.05, 20.0), num_bins: int = 15,
                     progress: Progress | None = None) -> list[PositionFit]:
    """Per-position temperatures, left to right on the cumulative survival.

    logits [N, gamma]; labels [N, gamma]: 1 if the accepted prefix reaches draft k, 0 if not, NaN censored.
    """
    check_fit_options(method=method, bounds=bounds, num_bins=num_bins)
    lo, hi = (float(b) for b in bounds)
    z = check_tensor("logits", logits).detach().to("cpu", torch.float64).numpy()
    y = check_tensor("labels", labels).detach().to("cpu", torch.float64).numpy()
    if z.ndim != 2 or z.shape != y.shape or z.shape[0] == 0:
        raise ValueError(f"logits and labels must be non-empty [N, gamma] of equal shape, got "
                         f"{tuple(logits.shape)} and {tuple(labels.shape)}")
    check_prefix_mask(torch.nan_to_num(labels.detach().cpu(), nan=0.0), "labels")
    check_prefix_mask(torch.isfinite(labels.detach().cpu()), "observed labels (censoring must be a suffix)")
    metric = metric_functions(num_bins)["ece_width" if method == "ece" else method]

    def score(p: np.ndarray, labels: np.ndarray) -> float:
        return metric(Sample.build(p, labels, sort=False), np.ones(p.size)) if p.size else math.nan

    # the served survival, position by position: float32 products of `confidence_host` at float32 T
    prev = np.ones(z.shape[0], dtype=np.float32)
    fits = []
    for k in range(z.shape[1]):
        obs = np.isfinite(y[:, k])
        zk, yk, pk = z[obs, k], y[obs, k], prev[obs]
        if zk.size == 0:
            t = np.float32(1)
        else:
            t = _served(_argmin_1d(lambda lt: score(pk * confidence_host(zk, _served(lt)), yk),
                                   math.log(lo), math.log(hi), refine=method != "ece"))
        occ = [occupied_bins(pk * confidence_host(zk, tt), num_bins) for tt in (np.float32(1), t)]
        at_bound = zk.size > 0 and min(abs(math.log(t / lo)), abs(math.log(t / hi))) < BOUND_TOL
        fits.append(PositionFit(k, float(t), int(zk.size), score(pk * confidence_host(zk, t), yk), bool(at_bound),
                                occ[0], occ[1]))
        prev = prev * confidence_host(z[:, k], t)
        if progress is not None:
            progress("fit", k + 1, z.shape[1])
    return fits


def split_by_request(request_ids: Tensor, holdout_fraction: float, seed: int) -> Tensor:
    """Bool mask [N] of held-out rows: a seeded random `holdout_fraction` of the distinct request ids."""
    check_fit_options(holdout_fraction=holdout_fraction, seed=seed)
    ids = torch.unique(request_ids)
    if ids.numel() < 2:
        raise ValueError(f"a held-out split needs at least 2 distinct request ids, got {ids.tolist()}")
    rng = np.random.default_rng(seed)
    n_hold = min(max(1, round(holdout_fraction * ids.numel())), ids.numel() - 1)
    held = ids[torch.from_numpy(rng.permutation(ids.numel())[:n_hold])]
    return torch.isin(request_ids, held)


def _summary(data: StsData, held: Tensor, policy: str) -> dict:
    y = data.labels.double().numpy()
    soft = data.soft.double().numpy()
    obs = np.isfinite(y)
    with np.errstate(invalid="ignore"):
        rate = np.nansum(y, axis=0) / obs.sum(axis=0)
        soft_mean = np.nansum(soft, axis=0) / np.isfinite(soft).sum(axis=0)
    return {"policy": policy, "rows": data.num_rows, "requests": int(torch.unique(data.request_ids).numel()),
            "heldout_rows": int(held.sum()), "heldout_requests": int(torch.unique(data.request_ids[held]).numel()),
            "observed_per_position": obs.sum(axis=0).tolist(), "accept_rate_per_position": rate.tolist(),
            "soft_accept_mean_per_position": soft_mean.tolist()}


def fit_sts(data: StsData, options: FitOptions = FitOptions(), *, policy: str | None = None,
            progress: Progress | None = None) -> Calibration:
    """Fit STS temperatures for one acceptance policy on the train requests; report on held-out ones.

    Args:
        data: the recorded rows (`load_sts`).
        options: the objective, search bounds, ECE bins, held-out share, bootstrap and seed.
        policy: the acceptance policy to fit (`POLICIES`; None: the one the data holds).
        progress: stage progress callback.
    Returns:
        The Calibration: temperatures [gamma], the held-out report and warnings.
    """
    check_type("options", options, FitOptions)
    method, bounds, num_bins, bootstrap = options.method, options.bounds, options.num_bins, options.bootstrap
    level, seed = options.level, options.seed
    data = check_type("data", data, StsData).cpu().validate()
    if data.num_rows == 0:
        raise ValueError("empty STS data: no rows to calibrate on")
    present = sorted({POLICIES[int(c)] for c in torch.unique(data.policy)})
    if policy is None:
        if len(present) != 1:
            raise ValueError(f"data mixes acceptance policies {present}; fit each one separately (policy=...)")
        policy = present[0]
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    data = data.select(data.policy == POLICIES.index(policy))
    if data.num_rows == 0:
        raise ValueError(f"no rows recorded under policy {policy!r} (present: {present})")
    held = split_by_request(data.request_ids, options.holdout_fraction, seed)
    train = data.select(~held)
    fits = fit_temperatures(train.logits, train.labels, method=method, bounds=bounds, num_bins=num_bins,
                            progress=progress)
    temps = [f.temperature for f in fits]
    warnings = []
    for f in fits:
        if f.rows == 0:
            warnings.append(f"position {f.position}: no observed (uncensored) training rows; temperature left at 1")
        if f.at_bound:
            warnings.append(f"position {f.position}: temperature {f.temperature:.4g} hit the search bound {bounds}")
        if f.collapsed:
            warnings.append(f"position {f.position}: the {method} fit collapsed all {f.rows} predictions into one "
                            f"ECE bin (of {num_bins}; {f.occupied_bins_before} occupied before): too little data "
                            "for a grid-searched ECE, use method='nll' or more rows")
    metrics = evaluate(data.select(held), temps, num_bins=num_bins, bootstrap=bootstrap, level=level, seed=seed,
                       progress=progress)
    metrics["fit"] = [asdict(f) | {"collapsed": f.collapsed} for f in fits]
    if not bool(torch.isfinite(data.margin).all()):
        warnings.append("no margin baseline: draft_logits were not recorded for every row (StsRecorder.record)")
    for ev, pos in metrics["head_worse_than_margin"].items():
        if pos:
            warnings.append(f"{ev} event: the confidence head ranks worse (AUROC) than the top-2 margin baseline "
                            f"at positions {pos}")
    return Calibration(temperatures=temps, gamma=data.gamma, policy=policy, method=method,
                       data=_summary(data, held, policy), metrics=metrics, warnings=warnings)
