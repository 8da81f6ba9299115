"""Least squares with non-negative coefficients (Lawson-Hanson active set), some coefficients left free.

The cost-model fits use it to keep a fitted curve's shape (non-decreasing, convex) where timing noise
would otherwise bend it; the problems are tiny (tens of coefficients), so plain numpy float64 suffices.
"""
from __future__ import annotations

import numpy as np


def nonnegative_lstsq(a: np.ndarray, y: np.ndarray, free: int = 0, *, tol: float = 1e-12,
                      max_iter: int | None = None) -> np.ndarray:
    """argmin ||a x - y|| over x with x[free:] >= 0 (the first `free` coefficients unconstrained).

    a: [n, p] float, y: [n]. The free columns are projected out, the rest is solved by Lawson-Hanson,
    and the free coefficients are then the least-squares fit to what remains.
    """
    a, y = np.asarray(a, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if a.ndim != 2 or y.shape != (a.shape[0],):
        raise ValueError(f"need a [n, p] and y [n], got {a.shape} and {y.shape}")
    if not 0 <= free <= a.shape[1]:
        raise ValueError(f"free must be in [0, {a.shape[1]}], got {free}")
    f, c = a[:, :free], a[:, free:]
    pinv = np.linalg.pinv(f) if free else np.zeros((0, a.shape[0]))
    c_res, y_res = c - f @ (pinv @ c), y - f @ (pinv @ y)
    w = _nnls(c_res, y_res, tol, max_iter or 10 * (c.shape[1] + 1))
    return np.concatenate([pinv @ (y - c @ w), w])


def _nnls(a: np.ndarray, y: np.ndarray, tol: float, max_iter: int) -> np.ndarray:
    """Lawson-Hanson: grow the passive set by the most violated gradient, step back when a passive
    coefficient would turn negative."""
    p = a.shape[1]
    x = np.zeros(p)
    passive = np.zeros(p, dtype=bool)
    scale = tol * max(1.0, float(np.abs(a).max(initial=0.0)) * float(np.abs(y).max(initial=0.0)))
    for _ in range(max_iter):
        grad = a.T @ (y - a @ x)
        grad[passive] = -np.inf
        j = int(np.argmax(grad)) if p else 0
        if not p or grad[j] <= scale:
            break
        passive[j] = True
        while True:
            z = np.zeros(p)
            z[passive] = np.linalg.lstsq(a[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            step = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + step * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x
