"""Calibration metrics of a temperature set on held-out data (`evaluate`): ECE, Brier, NLL and reliability per
draft position and for the cumulative events, each with a cluster-bootstrap interval over requests."""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from dspark.calibration.metrics import (
    Sample,
    bin_index,
    bootstrap_interval,
    ece_noise_floor,
    metric_functions,
)
from dspark.calibration.recorder import StsData
from dspark.plan.survival import calibrated_survival, confidence_host
from dspark.util.validate import check_type

Progress = Callable[[str, int, int], None]  # (stage, done, total)
ECE_FLOOR_DRAWS = 20  # simulated label sets for the ECE noise floor of a perfectly calibrated predictor


def _with_interval(fn: Callable, sample: Sample, bootstrap: int, level: float, seed: int) -> dict:
    lo, hi = bootstrap_interval(fn, sample, bootstrap, level, np.random.default_rng(seed))
    return {"value": fn(sample, np.ones(sample.p.size)), "ci": [lo, hi]}


def _block(p: np.ndarray, y: np.ndarray, groups: np.ndarray, num_bins: int, bootstrap: int, level: float,
           seed: int) -> dict:
    sample = Sample.build(p, y, groups)
    return {name: _with_interval(fn, sample, bootstrap, level, seed)
            for name, fn in metric_functions(num_bins).items()}


def _reliability(p: np.ndarray, y: np.ndarray, num_bins: int) -> dict:
    b = bin_index(p, num_bins)
    count = np.bincount(b, minlength=num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_p = np.bincount(b, weights=p, minlength=num_bins) / count
        freq = np.bincount(b, weights=y, minlength=num_bins) / count
    return {"mean_p": mean_p.tolist(), "freq": freq.tolist(), "count": count.tolist()}


def _event_report(events: dict, groups: np.ndarray, num_bins: int, bootstrap: int, level: float,
                  seed: int) -> dict:
    """events: name -> (rows mask, labels, before probs, after probs, margin score, soft proxy probs)."""
    rep = {}
    for name, (rows, y, before, after, margin, soft) in events.items():
        if not rows.any():
            rep[name] = None
            continue
        g, yy = groups[rows], y[rows]
        entry = {"rows": int(rows.sum()),
                 "before": _block(before[rows], yy, g, num_bins, bootstrap, level, seed),
                 "after": _block(after[rows], yy, g, num_bins, bootstrap, level, seed),
                 "ece_floor_after": {strategy: ece_noise_floor(after[rows], num_bins, strategy, ECE_FLOOR_DRAWS,
                                                               np.random.default_rng(seed))
                                     for strategy in ("width", "mass")},
                 "reliability": {"before": _reliability(before[rows], yy, num_bins),
                                 "after": _reliability(after[rows], yy, num_bins)}}
        m = margin[rows]
        if np.isfinite(m).all():
            entry["auroc_margin"] = _with_interval(metric_functions(num_bins)["auroc"], Sample.build(m, yy, g),
                                                   bootstrap, level, seed)
        if np.isfinite(soft[rows]).all():  # the training target 1 - TV used as the probability itself
            entry["soft_proxy"] = _block(np.clip(soft[rows], 0.0, 1.0), yy, g, num_bins, bootstrap, level, seed)
        rep[name] = entry
    return rep


def _margin_worse(rep: dict | None) -> bool:
    if not rep or "auroc_margin" not in rep:
        return False
    head, base = rep["after"]["auroc"]["value"], rep["auroc_margin"]["value"]
    return bool(math.isfinite(head) and math.isfinite(base) and head < base)


def evaluate(data: StsData, temperatures: list[float], *, num_bins: int = 15, bootstrap: int = 200,
             level: float = 0.95, seed: int = 0, progress: Progress | None = None) -> dict:
    """Held-out report: per position (conditional and cumulative events) and pooled, before vs after."""
    data = check_type("data", data, StsData).cpu()
    z = data.logits
    t = torch.tensor(temperatures, dtype=torch.float32)
    s_before = calibrated_survival(z).double().numpy()
    s_after = calibrated_survival(z, t).double().numpy()
    zf = z.double().numpy()
    c_before = confidence_host(zf, None).astype(np.float64)
    c_after = confidence_host(zf, t.numpy()).astype(np.float64)
    y = data.labels.double().numpy()
    margin = data.margin.double().numpy()
    margin_cum = np.minimum.accumulate(np.nan_to_num(margin, nan=np.inf), axis=1)
    margin_cum[np.isnan(margin)] = np.nan
    soft = data.soft.double().numpy()
    soft_cum = np.cumprod(soft, axis=1)  # NaN propagates: a cumulative proxy needs every earlier position
    groups = data.request_ids.numpy()
    obs = np.isfinite(y)
    positions = []
    for k in range(data.gamma):
        reached = obs[:, k] & ((y[:, k - 1] == 1) if k else True)
        events = {
            "conditional": (reached, y[:, k], c_before[:, k], c_after[:, k], margin[:, k], soft[:, k]),
            "cumulative": (obs[:, k], y[:, k], s_before[:, k], s_after[:, k], margin_cum[:, k], soft_cum[:, k]),
        }
        positions.append({"position": k, **_event_report(events, groups, num_bins, bootstrap, level, seed)})
        if progress is not None:
            progress("evaluate", k + 1, data.gamma)
    flat = lambda a: np.where(obs, a, 0.0).reshape(-1)  # noqa: E731
    rows = obs.reshape(-1)
    pooled_groups = np.repeat(groups, data.gamma)
    none = np.full(rows.size, np.nan)
    pooled = _event_report({"cumulative": (rows, flat(y), flat(s_before), flat(s_after), none, none)},
                           pooled_groups, num_bins, bootstrap, level, seed)["cumulative"]
    worse = {ev: [p["position"] for p in positions if _margin_worse(p[ev])] for ev in ("conditional", "cumulative")}
    return {"num_bins": num_bins, "bootstrap": bootstrap, "level": level, "positions": positions,
            "pooled_cumulative": pooled, "head_worse_than_margin": worse}
