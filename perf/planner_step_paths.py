"""Planner time per verify step on each path: host (numpy), device (torch ops, one host read) and sync-free.

For B in {1, 8, 64, 256} at gamma = 7, lag = 1, tiers = powers of two: the median wall time of one
`VerifyPlanner.plan` over a run of steps with fresh confidence logits each step, for
- `host`: CPU tensors planned on the host (the `auto` backend's numpy fast paths; on the CPU its survival
  copy is a view, so no read waits for anything);
- `device`: the device-side path (`DSPARK_KERNEL_BACKEND=torch` on the CPU: the torch references the GPU
  path compiles), one `boundary.to_host` read per step (the decision that fixes the rows);
- `sync_free`: the device path with `sync_free=True`: the budget from the host copy of the lag-ring row,
  no read at all.
Also the host reads per plan each path made (`dspark.verify.boundary.to_host` calls) and whether all three
gave identical verify_lens every step. On a GPU run with `--device cuda` (then `device` is the default path).

    PYTHONPATH=. python perf/planner_step_paths.py [--repeats 300] [--threads 1] [--device cpu]
                                                   [--out perf/results/planner_step_paths.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from dspark import AdditiveCostModel, BatchTerm, PlannerSettings, RowTerm, ScheduleConfig, VerifyPlanner
from dspark.kernels import dispatch
from dspark.util.fileio import atomic_write_text
from dspark.util.options import at_least, output_path
from dspark.verify import boundary

BATCHES = (1, 8, 64, 256)
GAMMA = 7
TIERS = tuple(2 ** i for i in range(3, 12))  # 8 .. 2048 >= 256 * W
PATHS = ("host", "device", "sync_free")


def bench_cost() -> AdditiveCostModel:
    """An illustrative additive table spanning every benchmarked shape (values are made up)."""
    return AdditiveCostModel(3e-3, BatchTerm([1, 64, 1024], [0.0, 1e-3, 6e-3]),
                             RowTerm([0, 256, 4096, 20000], [0.0, 1.5e-3, 30e-3, 160e-3]), platform="unknown")


def steps(b: int, count: int, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(b)
    return [(torch.randn(b, GAMMA, generator=gen) * 2 + 2.0).to(device) for _ in range(count)]


def time_path(path: str, b: int, logits: list[torch.Tensor], repeats: int, device: torch.device
              ) -> tuple[float, float, list[torch.Tensor]]:
    """(median seconds per plan, host reads per plan, verify_lens of the first len(logits) steps)."""
    backend = "torch" if path != "host" and device.type == "cpu" else "auto"
    previous = os.environ.get(dispatch.BACKEND_ENV)
    os.environ[dispatch.BACKEND_ENV] = backend
    reads = [0]
    real = boundary.to_host

    def counted(values):
        reads[0] += 1
        return real(values)

    boundary.to_host = counted
    try:
        planning = PlannerSettings(lag=1, num_slots=b, sync_free=path == "sync_free", tiers=TIERS,
                                   graph_slots=b + TIERS[-1] // (GAMMA + 1))
        planner = VerifyPlanner(ScheduleConfig(gamma=GAMMA), bench_cost(), planning, device=device)
        slots, gens = torch.arange(b), torch.zeros(b, dtype=torch.int64)
        lens = [planner.plan(z, slots, gens).verify_lens.cpu() for z in logits]  # also the warm-up
        reads[0] = 0
        times = []
        for i in range(repeats):
            z = logits[i % len(logits)]
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            planner.plan(z, slots, gens)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), reads[0] / repeats, lens
    finally:
        boundary.to_host = real
        if previous is None:
            os.environ.pop(dispatch.BACKEND_ENV, None)
        else:
            os.environ[dispatch.BACKEND_ENV] = previous


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=at_least(1), default=300)
    ap.add_argument("--threads", type=at_least(1), default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=output_path(), default="perf/results/planner_step_paths.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    print(f"{'B':>5} " + " ".join(f"{p + ' us':>12} {'reads':>5}" for p in PATHS) + f" {'dev/host':>8} "
          f"{'free/host':>9} {'identical':>9}")
    for b in BATCHES:
        logits = steps(b, 40, device)
        result = {p: time_path(p, b, logits, args.repeats, device) for p in PATHS}
        same = all(torch.equal(x, y) for p in PATHS[1:] for x, y in zip(result["host"][2], result[p][2]))
        row = {"B": b, "gamma": GAMMA, "identical_verify_lens": same,
               **{f"{p}_s": result[p][0] for p in PATHS}, **{f"{p}_reads_per_plan": result[p][1] for p in PATHS},
               "device_over_host": result["device"][0] / result["host"][0],
               "sync_free_over_host": result["sync_free"][0] / result["host"][0]}
        rows.append(row)
        print(f"{b:>5} " + " ".join(f"{result[p][0] * 1e6:>12.1f} {result[p][1]:>5.2f}" for p in PATHS)
              + f" {row['device_over_host']:>7.2f}x {row['sync_free_over_host']:>8.2f}x {same!s:>9}")
    record = {"benchmark": "planner_step_paths", "device": str(device), "repeats": args.repeats,
              "threads": args.threads, "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "load_average": os.getloadavg(),
              "gamma": GAMMA, "lag": 1, "tiers": list(TIERS), "cost_model": bench_cost().to_dict(), "rows": rows}
    atomic_write_text(args.out, json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    if not all(r["identical_verify_lens"] for r in rows):
        raise SystemExit("verify_lens differ between the planner paths")


if __name__ == "__main__":
    main()
