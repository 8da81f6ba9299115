"""Calibration and ranking metrics for survival probabilities: ECE, Brier, NLL, AUROC, bootstrap intervals.

All metrics take 1-D tensors (any device), evaluate in float64 on the CPU (offline analysis, not a hot
path) and return Python floats. Labels may be soft (in [0, 1]) except for AUROC, which needs 0/1.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import Tensor

NLL_EPS = 1.0e-12  # probabilities are clamped to [eps, 1 - eps] before the log (documented, finite NLL)


def _pair(probs: Tensor, labels: Tensor) -> tuple[np.ndarray, np.ndarray]:
    p = torch.as_tensor(probs).detach().to("cpu", torch.float64).reshape(-1).numpy()
    y = torch.as_tensor(labels).detach().to("cpu", torch.float64).reshape(-1).numpy()
    if p.shape != y.shape:
        raise ValueError(f"probs and labels must have the same length, got {p.size} and {y.size}")
    if p.size == 0:
        raise ValueError("metrics need at least one (probability, label) pair, got empty data")
    for name, v in (("probs", p), ("labels", y)):
        bad = ~np.isfinite(v) | (v < 0) | (v > 1)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{name} must be finite and in [0, 1]; {name}[{i}] = {v[i]}")
    return p, y


def bin_index(probs: np.ndarray, num_bins: int, strategy: str) -> np.ndarray:
    """Bin of each probability: equal-width bins on [0, 1] ("width") or equal-count bins ("mass")."""
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be an int >= 1, got {num_bins!r}")
    if strategy == "width":
        return np.minimum((probs * num_bins).astype(np.int64), num_bins - 1)
    if strategy == "mass":
        order = np.argsort(probs, kind="stable")
        idx = np.empty(probs.size, dtype=np.int64)
        idx[order] = (np.arange(probs.size) * num_bins) // probs.size
        return idx
    raise ValueError(f"strategy must be 'width' or 'mass', got {strategy!r}")


def _ece(p: np.ndarray, y: np.ndarray, num_bins: int, strategy: str) -> float:
    b = bin_index(p, num_bins, strategy)
    gap = np.bincount(b, weights=p - y, minlength=num_bins)
    return float(np.abs(gap).sum() / p.size)


def ece(probs: Tensor, labels: Tensor, num_bins: int = 15, strategy: str = "width") -> float:
    """Expected calibration error: sum over bins of (n_b / N) * |mean p_b - mean y_b|."""
    p, y = _pair(probs, labels)
    return _ece(p, y, num_bins, strategy)


def occupied_bins(probs: Tensor, num_bins: int = 15) -> int:
    """Number of non-empty equal-width bins (1 means the ECE sees a single mean: degenerate)."""
    p = torch.as_tensor(probs).detach().to("cpu", torch.float64).reshape(-1).numpy()
    return int(np.unique(bin_index(p, num_bins, "width")).size) if p.size else 0


def _brier(p: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((p - y) ** 2))


def brier(probs: Tensor, labels: Tensor) -> float:
    """Mean squared error of the probability against the label."""
    return _brier(*_pair(probs, labels))


def _nll(p: np.ndarray, y: np.ndarray) -> float:
    q = np.clip(p, NLL_EPS, 1.0 - NLL_EPS)
    return float(-np.mean(y * np.log(q) + (1.0 - y) * np.log1p(-q)))


def nll(probs: Tensor, labels: Tensor) -> float:
    """Mean binary cross-entropy (log loss), probabilities clamped to [1e-12, 1 - 1e-12]."""
    return _nll(*_pair(probs, labels))


def _rankdata(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    xs = x[order]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], xs.size]
    avg = (starts + ends - 1) / 2.0 + 1.0  # 1-based average rank of each tie group
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def _auroc(s: np.ndarray, y: np.ndarray) -> float:
    pos = y == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    r = _rankdata(s)
    return float((r[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def auroc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney, ties count half); NaN when only one class is present."""
    s = torch.as_tensor(scores).detach().to("cpu", torch.float64).reshape(-1).numpy()
    y = torch.as_tensor(labels).detach().to("cpu", torch.float64).reshape(-1).numpy()
    if s.shape != y.shape or s.size == 0:
        raise ValueError(f"scores and labels must be non-empty and of equal length, got {s.size} and {y.size}")
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError(f"AUROC labels must be 0/1, got values {np.unique(y)[:5].tolist()}")
    if not np.isfinite(s).all():
        raise ValueError(f"scores must be finite, got {s[~np.isfinite(s)][:3].tolist()}")
    return _auroc(s, y)


MetricFn = Callable[[np.ndarray, np.ndarray], float]


def metric_functions(num_bins: int) -> dict[str, MetricFn]:
    """The calibration report's metrics by name, on numpy (probs, labels)."""
    return {
        "ece_width": lambda p, y: _ece(p, y, num_bins, "width"),
        "ece_mass": lambda p, y: _ece(p, y, num_bins, "mass"),
        "brier": _brier,
        "nll": _nll,
        "auroc": _auroc,
    }


def bootstrap_interval(fn: MetricFn, scores: np.ndarray, labels: np.ndarray, groups: np.ndarray,
                       num_samples: int, level: float, rng: np.random.Generator) -> tuple[float, float]:
    """Percentile interval of `fn` over a cluster bootstrap (whole groups, e.g. requests, resampled)."""
    if num_samples < 1:
        return float("nan"), float("nan")
    order = np.argsort(groups, kind="stable")
    g = groups[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    sizes = np.diff(np.r_[starts, g.size])
    vals = []
    for _ in range(num_samples):
        pick = rng.integers(0, starts.size, size=starts.size)
        lens = sizes[pick]
        offs = np.repeat(starts[pick] - np.r_[0, np.cumsum(lens)[:-1]], lens) + np.arange(lens.sum())
        rows = order[offs]
        vals.append(fn(scores[rows], labels[rows]))
    v = np.asarray(vals)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return float("nan"), float("nan")
    a = (1.0 - level) / 2.0
    return float(np.quantile(v, a)), float(np.quantile(v, 1.0 - a))


def top2_margin(draft_logits: Tensor) -> Tensor:
    """Baseline confidence score: top-1 minus top-2 draft logit per position, [..., V] -> [...] float32."""
    if draft_logits.dim() < 1 or draft_logits.shape[-1] < 2:
        raise ValueError(f"draft_logits must be [..., V] with V >= 2, got {tuple(draft_logits.shape)}")
    top = torch.topk(draft_logits.to(torch.float32), 2, dim=-1).values
    return top[..., 0] - top[..., 1]
