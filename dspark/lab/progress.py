"""Line-per-unit progress for long jobs: reads the same in a terminal and in a log file."""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


class Progress:
    """One line per finished unit of work (`[ 12/40   35 s, eta 80 s] label`): reads the same in a terminal and
    in a log file. A unit past the total is a bug in the caller's count and raises."""

    def __init__(self, total: int, echo: Callable[[str], None] | None):
        self.total, self.done, self.echo, self.t0 = total, 0, echo, time.perf_counter()

    def __call__(self, label: str) -> None:
        self.done += 1
        if self.done > self.total:
            raise RuntimeError(f"progress counted {self.done} units of {self.total} ({label})")
        if self.echo is not None:
            el = time.perf_counter() - self.t0
            eta = el / self.done * (self.total - self.done)
            w = len(str(self.total))
            self.echo(f"[{self.done:>{w}}/{self.total} {el:5.0f} s, eta {eta:4.0f} s] {label}")


class StageProgress:
    """`progress(stage, done, total)` callbacks as plain lines (`    load  12/40    3.1 s`), at most about
    `lines` per stage (the last always): a long stage shows it moves without walling a log file."""

    def __init__(self, lines: int = 10, stream: TextIO | None = None):
        self.lines, self.stream, self.t0 = lines, stream, time.perf_counter()

    def __call__(self, stage: str, done: int, total: int) -> None:
        if done == total or done * self.lines // total != (done - 1) * self.lines // total:
            w = len(str(total))
            print(f"{stage:>8} {done:>{w}}/{total} {time.perf_counter() - self.t0:6.1f} s",
                  file=self.stream or sys.stderr, flush=True)
