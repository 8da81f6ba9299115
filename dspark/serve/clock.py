"""The clocks a step's phases are timed by: `wall` (perf_counter) or `thread` (this thread's CPU time: not
charged while preempted on a shared machine, exact with one intra-op thread); device events on cuda / npu."""
from __future__ import annotations

import time
from typing import Callable

import torch

CLOCK_FNS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}
CLOCKS = tuple(CLOCK_FNS)


def step_timer(device: torch.device, clock: str = "wall") -> Callable[[Callable[[], None]], float]:
    """Seconds of one call: device events on cuda / npu; on the CPU `wall` (perf_counter) or `thread`
    (this thread's CPU time: not charged while preempted on a shared machine, exact with 1 intra-op thread)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    if device.type in ("cuda", "npu"):
        mod = getattr(torch, device.type)

        def timed(fn: Callable[[], None]) -> float:
            start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return timed
    now = CLOCK_FNS[clock]

    def timed_cpu(fn: Callable[[], None]) -> float:
        t0 = now()
        fn()
        return now() - t0

    return timed_cpu
