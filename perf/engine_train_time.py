"""First-run training time of the reference engine's models (issue 9: <= 3 minutes on 2 CPU cores).

Trains the target and the draft (distillation, then the confidence head) into an empty temporary cache
with `dspark.engine.train.load_or_train`, exactly as the demo's first run does, and prints / writes the
wall seconds of each phase. Nothing is written to the real weight cache.

    PYTHONPATH=. python perf/engine_train_time.py [--threads 2]
"""
from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import torch

from dspark.engine.train import TrainConfig, load_or_train
from dspark.fileio import write_json_atomic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the demo trains on every core)")
    ap.add_argument("--out", default="perf/results/engine_train_time.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    last = [t0]

    def progress(phase: str, step: int, total: int, loss: float) -> None:
        if step == total:
            now = time.perf_counter()
            phases[phase] = now - last[0]
            last[0] = now
            print(f"{phase:<16} {phases[phase]:6.1f} s  (final loss {loss:.3f})", flush=True)

    with tempfile.TemporaryDirectory() as cache:
        load_or_train(TrainConfig(), Path(cache), progress)
    total = time.perf_counter() - t0
    print(f"{'total':<16} {total:6.1f} s  (threads {args.threads})")
    write_json_atomic(args.out, {
        "command": f"PYTHONPATH=. python perf/engine_train_time.py --threads {args.threads}",
        "platform": platform.machine(), "threads": args.threads, "phase_seconds": phases, "total_seconds": total,
        "train_key": TrainConfig().key()})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
