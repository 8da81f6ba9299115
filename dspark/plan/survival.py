"""Calibrated survival from confidence logits, and the lag ring with its generation guard.

`s[r, k] = prod_{i<=k} sigmoid(z[r, i] / T_i)` is P(the accepted prefix of request r reaches draft k).
One formula, two backends (numpy on the host, torch ops on devices and inside `torch.compile`), one
fixed order: the confidence `c = 1 / (1 + exp(-z / T))` in float64, rounded once to float32, then the
left-to-right float32 product; the STS fitter fits with the same host function (`confidence_host`).
Why float64: a float32 sigmoid is not correctly rounded and its implementations differ in the last bit
(on the CPU torch runs the vectorised body and the scalar tail of a tensor through different code, so a
request's bits depended on its batch size and position; CUDA's expf is a third). In float64 they differ
by at most an ulp of float64, which the rounding to float32 hides, so a request's survival does not
depend on its batch, and paths and ranks agree. The division cannot overflow either: a finite logit
keeps its confidence (3e38 / 0.5 gives c = 1); non-finite logits give c = 0.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from dspark.kernels import dispatch
from dspark.util.validate import check_int, check_tensor, check_type, first_duplicate
from dspark.verify import boundary

_NUMPY_FLOATS = (torch.float32, torch.float64)  # logits the host path reads without a torch cast


def _check_matrix(name: str, x: object) -> Tensor:
    check_tensor(name, x)
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [B, gamma], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    return x


def check_temperatures(temperatures: Tensor | Sequence[float], gamma: int) -> Tensor:
    """Validated STS temperatures.

    Args:
        temperatures: [gamma] tensor or sequence of reals, finite and > 0.
        gamma: drafts per request.
    Returns:
        float32 [gamma] tensor: on the CPU; inside `torch.compile` on the tensor's device, with the values
        not read (only the length is checked).
    """
    if dispatch.tracing():
        t = torch.as_tensor(temperatures).reshape(-1)
        if t.numel() != gamma:
            raise ValueError(f"temperatures must have length gamma={gamma}, got {t.numel()}")
        return t.to(torch.float32)
    if not isinstance(temperatures, Tensor):
        values = list(check_type("temperatures", temperatures, (list, tuple, np.ndarray)))
        for i, v in enumerate(values):
            check_type(f"temperatures[{i}]", v, numbers.Real)
    t = torch.as_tensor(temperatures, dtype=torch.float64).detach().cpu().reshape(-1)
    if t.numel() != gamma:
        raise ValueError(f"temperatures must have length gamma={gamma}, got {t.numel()}: {t.tolist()}")
    bad = ~torch.isfinite(t) | (t <= 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"temperatures must be finite and > 0; temperatures[{i}] = {t[i].item()}")
    return t.to(torch.float32)


def calibrated_survival(logits: Tensor, temperatures: Tensor | Sequence[float] | None = None) -> Tensor:
    """Survival `s[r, k] = prod_{i<=k} sigmoid(z[r, i] / T_i)`; non-finite logits give c = 0.

    Args:
        logits: floating [B, gamma >= 1] confidence logits.
        temperatures: STS temperatures [gamma] (`check_temperatures`), or None for T = 1.
    Returns:
        float32 [B, gamma] on the logits' device, non-increasing along positions.
    """
    z = _check_matrix("logits", logits)
    gamma = z.shape[1]
    if gamma == 0:
        raise ValueError("logits must have at least one draft position (gamma >= 1), got shape "
                         f"{tuple(z.shape)}")
    return _survival(z, None if temperatures is None else check_temperatures(temperatures, gamma))


def _survival(logits: Tensor, temperatures: Tensor | None, host: bool = False) -> Tensor:
    """`calibrated_survival` without its checks, for callers that validated once (same bits).

    Args:
        logits: floating [B, gamma >= 1].
        temperatures: float32 [gamma] as `check_temperatures` returns it, or None.
        host: take the numpy host path (`survival_host`; CPU logits, chosen by the planner), else torch ops.
    Returns:
        float32 [B, gamma] on the logits' device.
    """
    if host:
        t = None if temperatures is None else temperatures.numpy()
        # float32 / float64 logits are read as they are (numpy's cast to float64 is exact, as torch's)
        z = logits.numpy() if logits.dtype in _NUMPY_FLOATS else logits.to(torch.float64).numpy()
        return torch.from_numpy(survival_host(z.astype(np.float64, copy=False), t))
    return _cumulative_torch(_confidence_torch(logits, temperatures))


def confidence_host(logits: np.ndarray, temperatures: np.ndarray | np.float32 | None) -> np.ndarray:
    """Conditional confidence `c = 1 / (1 + exp(-z / T))` in float64, rounded once to float32.

    The formula the planner serves and the STS fitter fits (`dspark.calibration.fit`).
    Args:
        logits: float64 array of any shape.
        temperatures: float32, broadcastable to the logits (or None for T = 1).
    Returns:
        float32 array of the logits' shape; 0 where the logit is not finite.
    """
    finite = np.isfinite(logits)
    z = logits if temperatures is None else logits / np.asarray(temperatures, dtype=np.float64)
    every = bool(finite.all())  # the common case: no masking
    # z below -700 gives c < 1e-304, 0 in float32 either way: the clamp keeps exp(-z) from overflowing
    c = (1.0 / (1.0 + np.exp(-np.maximum(z if every else np.where(finite, z, 0.0), -700.0)))).astype(np.float32)
    return c if every else np.where(finite, c, np.float32(0))


def survival_host(logits: np.ndarray, temperatures: np.ndarray | None) -> np.ndarray:
    """Host survival: `confidence_host`, then numpy's left-to-right float32 product along positions.

    Args:
        logits: float64 [B, gamma]; temperatures: float32 [gamma] or None.
    Returns:
        float32 [B, gamma].
    """
    return np.multiply.accumulate(confidence_host(logits, temperatures), axis=1)


def _confidence_torch(logits: Tensor, temperatures: Tensor | None) -> Tensor:
    z = logits.to(torch.float64)
    finite = torch.isfinite(z)
    if temperatures is not None:
        z = z / temperatures.to(z.device, torch.float64)
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    c = (1.0 / (1.0 + torch.exp(-torch.where(finite, z, zero)))).to(torch.float32)
    return torch.where(finite, c, zero.to(torch.float32))


def _cumulative_torch(conditional: Tensor) -> Tensor:
    """One column at a time, left to right (torch's CPU cumprod accumulates float32 in float64; GPUs scan)."""
    cols = conditional.unbind(1)
    out = [cols[0]]
    for col in cols[1:]:
        out.append(out[-1] * col)
    return torch.stack(out, dim=1)


def monotone_survival(survival: Tensor) -> Tensor:
    """Survival handed in directly, made usable (DESIGN.md 4.3).

    Args:
        survival: floating [B, gamma].
    Returns:
        float32 [B, gamma]: NaN -> 0, then the running minimum along positions.
    """
    s = _check_matrix("survival", survival).to(torch.float32)
    s = torch.nan_to_num(s, nan=0.0)
    if s.shape[1] == 0:
        return s
    return torch.cummin(s, dim=1).values


def monotone_host(values: np.ndarray) -> np.ndarray:
    """`monotone_survival` of a host float32 [B, gamma] array: the array itself when it is already
    non-increasing along positions and NaN-free (one comparison pass), else the repaired copy."""
    if values.size == 0:
        return values
    gamma = values.shape[1]
    flat = values.reshape(-1)
    ok = flat[1:] <= flat[:-1]  # False at any NaN and at any rise
    ok[gamma - 1:: gamma] = True  # across a row boundary
    if bool(ok.all()) if gamma > 1 else not np.isnan(flat).any():
        return values
    return monotone_survival(torch.from_numpy(values)).numpy()


@dataclass(frozen=True)
class HostRingRow:
    """A host copy of one lag-ring row in flight (`SurvivalLagRing.next_row_to_host`): numpy views of the
    ring's host buffers, valid until the next `next_row_to_host`."""

    values: np.ndarray          # [num_slots, gamma] float32
    stamps: np.ndarray          # [num_slots] int64 generation stamps
    event: object | None        # CUDA event recorded after the copy (None: the copy was synchronous)

    def read(self, slots: Tensor, generations: Tensor) -> np.ndarray:
        """Lagged survival [B, gamma] float32 (host) for these slots, all-ones where stale or reused: what
        `SurvivalLagRing.read` returns at the next step, bit for bit, read without a device sync."""
        if self.event is not None:
            self.event.synchronize()  # enqueued a step ago: done by the time the step's commit read returned
        slots, gens = slots.cpu().numpy(), generations.cpu().numpy()
        fresh = self.stamps[slots] == gens
        return np.where(fresh[:, None], self.values[slots], np.float32(1))


class SurvivalLagRing:
    """Per-slot survival history `lag` steps deep, each row stamped with its generation at write time.

    `exchange` returns, for the given slots, the survival written at least `lag` exchanges ago under the
    same generation, or all-ones (optimistic) when the slot was never written or was reused by a new
    request (generation guard), then stores the live survival in its place.
    """

    def __init__(self, num_slots: int, gamma: int, lag: int = 1, device: torch.device | str = "cpu"):
        for name, v, lo in (("num_slots", num_slots, 1), ("gamma", gamma, 1), ("lag", lag, 1)):
            check_int(name, v, lo)
        self.num_slots, self.gamma, self.lag = num_slots, gamma, lag
        self._values = torch.ones(lag, num_slots, gamma, dtype=torch.float32, device=device)
        self._stamps = torch.full((lag, num_slots), -1, dtype=torch.int64, device=device)
        self._cursor = 0
        self._host_row: tuple[Tensor, Tensor, np.ndarray, np.ndarray] | None = None

    def check(self, slots: Tensor, generations: Tensor, survival: Tensor | None = None) -> None:
        """Validate one step's inputs: slots / generations [B] integer (slots distinct, in [0, num_slots);
        generations >= 0), survival [B, gamma] when given."""
        check_tensor("slots", slots)
        check_tensor("generations", generations)
        if survival is not None:
            check_tensor("survival", survival)
        if slots.dim() != 1 or generations.shape != slots.shape:
            raise ValueError(
                f"slots and generations must be 1-D of equal length, got {tuple(slots.shape)} "
                f"and {tuple(generations.shape)}"
            )
        if slots.dtype.is_floating_point or generations.dtype.is_floating_point:
            raise TypeError(f"slots/generations must be integer tensors, got {slots.dtype}/{generations.dtype}")
        if survival is not None and tuple(survival.shape) != (slots.numel(), self.gamma):
            raise ValueError(
                f"survival must be [{slots.numel()}, {self.gamma}], got {tuple(survival.shape)}"
            )
        if not slots.numel():
            return
        # slots and generations are host-side scheduling data: read as they are (no copy on the CPU)
        host_slots, host_gens = slots.cpu().numpy(), generations.cpu().numpy()
        lo, hi = int(host_slots.min()), int(host_slots.max())
        if lo < 0 or hi >= self.num_slots:
            raise ValueError(f"slots must lie in [0, {self.num_slots}), got min {lo} max {hi}")
        if int(host_gens.min()) < 0:
            raise ValueError(f"generations must be >= 0, got {int(host_gens.min())}")
        if np.unique(host_slots).size != host_slots.size:  # two requests would write one ring row
            value, i, j = first_duplicate(slots.cpu())
            raise ValueError(f"slots must be distinct within a step, got slot {value} at positions {i} and {j}")

    def read(self, slots: Tensor, generations: Tensor) -> Tensor:
        """Lagged survival [B, gamma] for these slots (all-ones where stale or reused)."""
        self.check(slots, generations)
        return self._read(slots, generations)

    def write(self, slots: Tensor, generations: Tensor, survival: Tensor) -> None:
        """Store live survival for these slots, stamped with their generation, and advance one step."""
        self.check(slots, generations, survival)
        self._write(slots, generations, survival)

    def exchange(self, slots: Tensor, generations: Tensor, survival: Tensor) -> Tensor:
        """read() then write() with one validation: the lagged survival for this step, the live one stored."""
        self.check(slots, generations, survival)
        return self._exchange(slots, generations, survival)

    def _exchange(self, slots: Tensor, generations: Tensor, survival: Tensor) -> Tensor:
        """`exchange` without its checks, for a planner that validated the step's inputs once."""
        lagged = self._read(slots, generations)
        self._write(slots, generations, survival)
        return lagged

    def next_row_to_host(self) -> HostRingRow:
        """Start copying the ring row the next `exchange` reads (values and generation stamps) to the host,
        without waiting for it: what the sync-free planner budgets the next step from. On CUDA the copy
        goes to pinned memory behind an event; the step's commit-length read waits for it anyway."""
        pin = boundary.pinned(self._values.device)
        if self._host_row is None:  # host buffers and their numpy views, made once
            values = torch.empty(self._values.shape[1:], dtype=self._values.dtype, pin_memory=pin)
            stamps = torch.empty(self._stamps.shape[1:], dtype=self._stamps.dtype, pin_memory=pin)
            self._host_row = (values, stamps, values.numpy(), stamps.numpy())
        values, stamps, values_np, stamps_np = self._host_row
        values.copy_(self._values[self._cursor], non_blocking=pin)
        stamps.copy_(self._stamps[self._cursor], non_blocking=pin)
        return HostRingRow(values_np, stamps_np, boundary.copy_done(self._values.device) if pin else None)

    def _read(self, slots: Tensor, generations: Tensor) -> Tensor:
        slots = boundary.to_device(slots, self._values.device, torch.long)
        gens = boundary.to_device(generations, self._values.device, torch.int64)
        vals = self._values[self._cursor].index_select(0, slots)
        fresh = self._stamps[self._cursor].index_select(0, slots) == gens
        return torch.where(fresh.unsqueeze(1), vals, torch.ones_like(vals))

    def _write(self, slots: Tensor, generations: Tensor, survival: Tensor) -> None:
        slots = boundary.to_device(slots, self._values.device, torch.long)
        self._values[self._cursor].index_copy_(0, slots, survival.to(self._values))
        self._stamps[self._cursor].index_copy_(0, slots, boundary.to_device(generations, self._stamps.device,
                                                                             self._stamps.dtype))
        self._cursor = (self._cursor + 1) % self.lag
