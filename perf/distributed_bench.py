"""Per-step agreement overhead on CPU gloo: 2 and 4 local ranks, side by side with the local work.

Per world size, every rank times (median over interleaved repeats of the mean over `--steps` steps):
  hash            verify_lens_hash alone (local, no collective)
  tp_verify       TpAgreement(mode="verify").agree: hash + one 4 x int32 MAX all-reduce + host check
  tp_broadcast    TpAgreement(mode="broadcast").agree: one [B] int32 broadcast
  allreduce_4     a bare 4 x int32 all-reduce (the collective floor of tp_verify)
  hash_allreduce  the hash, then the bare all-reduce: the control for tp_verify (on a loaded box any
                  local work before a collective adds a wake-up; tp_verify - hash_allreduce is the
                  cost of the fold and the check alone)
  layout_local    RaggedVerifyLayout.from_verify_lens with the local tier (what a single rank pays)
  dp_step         DpTierAgreement.step: one CPU all-gather + the layout padded to the global tier
The table reports the slowest rank (it gates the step) and the DP overhead dp_step - layout_local.

    PYTHONPATH=. python perf/distributed_bench.py [--worlds 2 4] [--batch 64] [--steps 200] [--repeats 5]
        [--out perf/results/distributed_bench.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from dspark.parallel import DpTierAgreement, TpAgreement, verify_lens_hash
from dspark.parallel.launch import run_local_gloo
from dspark.util.fileio import atomic_write_text
from dspark.util.options import at_least, output_path
from dspark.verify.layout import RaggedVerifyLayout

GAMMA = 7
WIDTH = GAMMA + 1
CASES = ("hash", "tp_verify", "tp_broadcast", "allreduce_4", "hash_allreduce", "layout_local", "dp_step")


def _time_interleaved(cases: dict[str, Callable[[int], object]], steps: int, repeats: int) -> dict[str, float]:
    """Per case: median over repeats of the mean seconds per step. Repeats interleave the cases, so a
    load change on a shared machine hits every case alike; one warm-up round first."""
    per: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(repeats + 1):
        for name, fn in cases.items():
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(steps):
                fn(i)
            if rep:
                per[name].append((time.perf_counter() - t0) / steps)
    return {name: statistics.median(v) for name, v in per.items()}


def rank_bench(rank: int, world: int, batch: int, steps: int, repeats: int) -> dict[str, float]:
    """Every case on this rank; DP ranks get different batch sizes, the last one idle."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    tp_lens = [torch.randint(1, WIDTH + 1, (batch,), generator=g, dtype=torch.int32) for _ in range(16)]
    dp_batch = 0 if rank == world - 1 else batch // (rank + 1)
    dp_lens = [torch.randint(1, WIDTH + 1, (dp_batch,), generator=g, dtype=torch.int32) for _ in range(16)]
    tiers = tuple(range(32, batch * WIDTH + 1, 32))
    slots = batch + 16
    verify, bcast = TpAgreement(None, "verify"), TpAgreement(None, "broadcast")
    dp = DpTierAgreement(None, tiers, slots, WIDTH)
    same = [torch.full((batch,), 4, dtype=torch.int32)] * 16  # verify mode needs agreeing ranks
    floor = torch.zeros(4, dtype=torch.int32)
    cases = {
        "hash": lambda i: verify_lens_hash(tp_lens[i % 16]),
        "tp_verify": lambda i: verify.agree(same[i % 16]),
        "tp_broadcast": lambda i: bcast.agree(tp_lens[i % 16]),
        "allreduce_4": lambda i: dist.all_reduce(floor, op=dist.ReduceOp.MAX),
        "hash_allreduce": lambda i: (verify_lens_hash(same[i % 16]), dist.all_reduce(floor, op=dist.ReduceOp.MAX)),
        "layout_local": lambda i: RaggedVerifyLayout.from_verify_lens(dp_lens[i % 16], tiers, slots, width=WIDTH),
        "dp_step": lambda i: dp.step(dp_lens[i % 16]),
    }
    return _time_interleaved(cases, steps, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=at_least(1), nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=at_least(1), default=64)
    ap.add_argument("--steps", type=at_least(1), default=200)
    ap.add_argument("--repeats", type=at_least(1), default=5)
    ap.add_argument("--out", type=output_path(), default="perf/results/distributed_bench.json")
    args = ap.parse_args()
    rows = []
    for world in args.worlds:
        per_rank = run_local_gloo(rank_bench, world, args=(args.batch, args.steps, args.repeats),
                                  timeout=600.0)
        slowest = {name: max(r[name] for r in per_rank) for name in CASES}
        rows.append({"world": world, "slowest_rank_us": {k: v * 1e6 for k, v in slowest.items()},
                     "per_rank_us": [{k: v * 1e6 for k, v in r.items()} for r in per_rank],
                     "dp_overhead_us": (slowest["dp_step"] - slowest["layout_local"]) * 1e6})
    print(f"per-step agreement cost, gloo on CPU, B={args.batch}, gamma={GAMMA} (slowest rank, microseconds)")
    print(f"{'world':>5} " + " ".join(f"{c:>14}" for c in CASES) + f" {'dp_overhead':>12}")
    for r in rows:
        us = r["slowest_rank_us"]
        print(f"{r['world']:>5} " + " ".join(f"{us[c]:>14.1f}" for c in CASES) + f" {r['dp_overhead_us']:>12.1f}")
    result = {
        "bench": "distributed_bench", "batch": args.batch, "gamma": GAMMA, "steps": args.steps,
        "repeats": args.repeats, "backend": "gloo", "torch": torch.__version__, "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "results": rows,
    }
    atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
