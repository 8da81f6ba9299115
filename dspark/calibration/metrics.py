"""Calibration and ranking metrics for survival probabilities: ECE, Brier, NLL, AUROC, bootstrap intervals.

All metrics take 1-D tensors (any device), evaluate in float64 on the CPU (offline analysis, not a hot
path) and return Python floats. Labels may be soft (in [0, 1]) except for AUROC, which needs 0/1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from dspark.util.validate import check_int, check_tensor, check_type

NLL_EPS = 1.0e-12  # probabilities are clamped to [eps, 1 - eps] before the log (documented, finite NLL)


def _host_vector(name: str, values: object) -> np.ndarray:
    """A tensor, array or list of numbers as a flat float64 host array (TypeError naming anything else)."""
    check_type(name, values, (Tensor, np.ndarray, list, tuple))
    return torch.as_tensor(values).detach().to("cpu", torch.float64).reshape(-1).numpy()


def _pair(probs: Tensor, labels: Tensor) -> tuple[np.ndarray, np.ndarray]:
    p, y = _host_vector("probs", probs), _host_vector("labels", labels)
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


def check_num_bins(num_bins: int) -> int:
    return check_int("num_bins", num_bins, 1)


def bin_index(probs: np.ndarray, num_bins: int) -> np.ndarray:
    """Equal-width bin of each probability on [0, 1] (p = 1 falls in the last bin)."""
    return np.minimum((probs * check_num_bins(num_bins)).astype(np.int64), num_bins - 1)


@dataclass(frozen=True)
class Sample:
    """(probability or score, label) pairs sorted by score, with tie groups and request clusters.

    Every metric is a weighted statistic over this fixed order, so a bootstrap replicate is a weight
    vector (how often each row's cluster was drawn) and never re-sorts.
    """

    p: np.ndarray         # [n] float64, ascending
    y: np.ndarray         # [n] float64
    ties: np.ndarray      # start index of each run of equal scores
    cluster: np.ndarray   # [n] cluster index in [0, num_clusters)
    num_clusters: int

    @staticmethod
    def build(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray | None = None,
              sort: bool = True) -> "Sample":
        """Sort by score (stable); `groups` (e.g. request ids) become bootstrap clusters.

        sort=False keeps the given order, one cluster and no tie runs: only for ECE width, Brier and NLL.
        """
        p, y = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=np.float64)
        if not sort:
            if groups is not None:
                raise ValueError("Sample.build(sort=False) takes no groups (bootstrap needs the sorted form)")
            return Sample(p, y, np.zeros(0, dtype=np.int64), np.zeros(p.size, dtype=np.int64), min(p.size, 1))
        order = np.argsort(p, kind="stable")
        p, y = p[order], y[order]
        if groups is None:
            cluster, num = np.zeros(p.size, dtype=np.int64), min(p.size, 1)
        else:
            _, cluster = np.unique(np.asarray(groups)[order], return_inverse=True)
            cluster = cluster.reshape(-1)
            num = int(cluster.max()) + 1 if p.size else 0
        ties = np.flatnonzero(np.r_[True, p[1:] != p[:-1]]) if p.size else np.zeros(0, dtype=np.int64)
        return Sample(p, y, ties, cluster, num)


Metric = Callable[[Sample, np.ndarray], float]


def _ece(s: Sample, w: np.ndarray, num_bins: int, strategy: str) -> float:
    if strategy == "width":
        b = bin_index(s.p, num_bins)
    elif strategy == "mass":  # rows sorted: bin = weight strictly before the row, in bins of W / num_bins
        # (a weighted row never straddles a bin edge; with unit weights this is the plain equal-count split)
        before = np.cumsum(w) - w
        b = np.minimum((before * num_bins / w.sum()).astype(np.int64), num_bins - 1)
    else:
        raise ValueError(f"strategy must be 'width' or 'mass', got {strategy!r}")
    gap = np.bincount(b, weights=w * (s.p - s.y), minlength=num_bins)
    return float(np.abs(gap).sum() / w.sum())


def _brier(s: Sample, w: np.ndarray) -> float:
    return float(np.sum(w * (s.p - s.y) ** 2) / w.sum())


def _nll(s: Sample, w: np.ndarray) -> float:
    q = np.clip(s.p, NLL_EPS, 1.0 - NLL_EPS)
    return float(-np.sum(w * (s.y * np.log(q) + (1.0 - s.y) * np.log1p(-q))) / w.sum())


def _auroc(s: Sample, w: np.ndarray) -> float:
    pos = np.add.reduceat(w * s.y, s.ties)
    neg = np.add.reduceat(w * (1.0 - s.y), s.ties)
    n_pos, n_neg = pos.sum(), neg.sum()
    if n_pos <= 0 or n_neg <= 0:
        return float("nan")
    below = np.cumsum(neg) - neg  # negatives with a strictly lower score; ties count half
    return float(np.sum(pos * (below + 0.5 * neg)) / (n_pos * n_neg))


def metric_functions(num_bins: int) -> dict[str, Metric]:
    """The calibration report's metrics by name, as weighted statistics of a Sample."""
    return {
        "ece_width": lambda s, w: _ece(s, w, num_bins, "width"),
        "ece_mass": lambda s, w: _ece(s, w, num_bins, "mass"),
        "brier": _brier,
        "nll": _nll,
        "auroc": _auroc,
    }


def _value(fn: Metric, scores: np.ndarray, labels: np.ndarray) -> float:
    s = Sample.build(scores, labels)
    return fn(s, np.ones(s.p.size))


def ece(probs: Tensor, labels: Tensor, num_bins: int = 15, strategy: str = "width") -> float:
    """Expected calibration error: sum over bins of (n_b / N) * |mean p_b - mean y_b|."""
    check_num_bins(num_bins)
    if strategy not in ("width", "mass"):
        raise ValueError(f"strategy must be 'width' or 'mass', got {strategy!r}")
    return _value(lambda s, w: _ece(s, w, num_bins, strategy), *_pair(probs, labels))


def occupied_bins(probs: np.ndarray, num_bins: int = 15) -> int:
    """Number of non-empty equal-width bins (1 means the ECE sees a single mean: degenerate)."""
    return int(np.unique(bin_index(np.asarray(probs, dtype=np.float64), num_bins)).size)


def brier(probs: Tensor, labels: Tensor) -> float:
    """Mean squared error of the probability against the label."""
    return _value(_brier, *_pair(probs, labels))


def nll(probs: Tensor, labels: Tensor) -> float:
    """Mean binary cross-entropy (log loss), probabilities clamped to [1e-12, 1 - 1e-12]."""
    return _value(_nll, *_pair(probs, labels))


def auroc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney, ties count half); NaN when only one class is present."""
    s, y = _host_vector("scores", scores), _host_vector("labels", labels)
    if s.shape != y.shape or s.size == 0:
        raise ValueError(f"scores and labels must be non-empty and of equal length, got {s.size} and {y.size}")
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError(f"AUROC labels must be 0/1, got values {np.unique(y)[:5].tolist()}")
    if not np.isfinite(s).all():
        raise ValueError(f"scores must be finite, got {s[~np.isfinite(s)][:3].tolist()}")
    return _value(_auroc, s, y)


def _percentile_interval(stat: Callable[[np.ndarray], float], num_clusters: int, num_samples: int, level: float,
                         rng: np.random.Generator) -> tuple[float, float]:
    """Percentile interval of stat(cluster counts [num_clusters]) over num_samples cluster resamples."""
    if num_samples < 1 or num_clusters == 0:
        return float("nan"), float("nan")
    vals = []
    for _ in range(num_samples):
        draws = np.bincount(rng.integers(0, num_clusters, num_clusters), minlength=num_clusters)
        vals.append(stat(draws.astype(np.float64)))
    v = np.asarray(vals)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return float("nan"), float("nan")
    a = (1.0 - level) / 2.0
    return float(np.quantile(v, a)), float(np.quantile(v, 1.0 - a))


def bootstrap_interval(fn: Metric, sample: Sample, num_samples: int, level: float,
                       rng: np.random.Generator) -> tuple[float, float]:
    """Percentile interval of `fn` over a cluster bootstrap (whole clusters, e.g. requests, redrawn)."""
    return _percentile_interval(lambda c: fn(sample, c[sample.cluster]), sample.num_clusters, num_samples, level,
                                rng)


def paired_difference_interval(fn: Metric, a: Sample, b: Sample, num_samples: int, level: float,
                               rng: np.random.Generator) -> tuple[float, float]:
    """Percentile interval of fn(a) - fn(b) over one cluster bootstrap shared by both.

    a, b: two scorings of the same rows, built with the same `groups` (each replicate redraws the same
    clusters for both, so what the two have in common cancels).
    """
    if a.num_clusters != b.num_clusters:
        raise ValueError(f"paired samples must share their clusters, got {a.num_clusters} and {b.num_clusters}")
    return _percentile_interval(lambda c: fn(a, c[a.cluster]) - fn(b, c[b.cluster]), a.num_clusters, num_samples,
                                level, rng)


def ece_noise_floor(probs: np.ndarray, num_bins: int, strategy: str, draws: int,
                    rng: np.random.Generator) -> float:
    """Mean ECE of a perfectly calibrated predictor with these probabilities (labels ~ Bernoulli(p)).

    ECE is biased upwards on finite data; an ECE near this floor is as good as the sample size allows.
    """
    s = Sample.build(probs, np.zeros(np.size(probs)))
    w = np.ones(s.p.size)
    vals = [_ece(Sample(s.p, (rng.random(s.p.size) < s.p).astype(np.float64), s.ties, s.cluster, s.num_clusters),
                 w, num_bins, strategy) for _ in range(draws)]
    return float(np.mean(vals)) if vals else float("nan")


def top2_margin(draft_logits: Tensor) -> Tensor:
    """Baseline confidence score: top-1 minus top-2 draft logit per position, [..., V] -> [...] float32."""
    if check_tensor("draft_logits", draft_logits).dim() < 1 or draft_logits.shape[-1] < 2:
        raise ValueError(f"draft_logits must be [..., V] with V >= 2, got {tuple(draft_logits.shape)}")
    top = torch.topk(draft_logits.to(torch.float32), 2, dim=-1).values
    return top[..., 0] - top[..., 1]
