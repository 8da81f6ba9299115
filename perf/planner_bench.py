"""Planner decision latency on the CPU: dspark vs a plain three-argsort implementation of the same decision.

For B in {1, 8, 64, 256, 1024} x gamma in {4, 7, 16}: median wall time of
`choose_budget + allocate_verify_lens` (dspark) and of `baseline_decision` (one global order built from
three stable argsorts: request, then position, then survival desc; tau curve and allocation read off that
order), their ratio, and whether both give identical budgets and verify_lens.

    PYTHONPATH=. python perf/planner_bench.py [--repeats 200] [--threads 1] [--out perf/results/planner_bench.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from dspark import (
    AdditiveCostModel,
    ScheduleConfig,
    allocate_verify_lens,
    calibrated_survival,
    choose_budget,
)
from dspark.cli.options import at_least, output_path
from dspark.plan.survival import monotone_survival
from dspark.util.fileio import atomic_write_text

BATCHES = (1, 8, 64, 256, 1024)
GAMMAS = (4, 7, 16)
GOAL = (256, 7)  # the target row: >= 3x over the baseline


def bench_cost() -> AdditiveCostModel:
    """An illustrative additive table spanning every benchmarked shape (values are made up)."""
    return AdditiveCostModel(3e-3, [1, 64, 1024], [0.0, 1e-3, 6e-3], [0, 256, 4096, 20000],
                             [0.0, 1.5e-3, 30e-3, 160e-3], platform="illustrative")


def baseline_decision(survival: torch.Tensor, cost: AdditiveCostModel, cfg: ScheduleConfig) -> tuple[int, torch.Tensor]:
    """The same decision, written plainly: three stable argsorts give the global order."""
    s = monotone_survival(survival)
    b = s.shape[0]
    cand = s[:, cfg.floor - 1: cfg.cap - 1]
    c = cand.shape[1]
    val = cand.reshape(-1)
    valid = val >= cfg.survival_eps
    req = torch.arange(b).repeat_interleave(c)
    pos = torch.arange(c).repeat(b)
    order = torch.argsort(req, stable=True)
    order = order[torch.argsort(pos[order], stable=True)]
    key = torch.where(valid, val, torch.full_like(val, -1.0))
    order = order[torch.argsort(key[order], descending=True, stable=True)]
    gains = torch.where(valid, val, torch.zeros_like(val))[order].to(torch.float64)
    floor = b + s[:, : cfg.floor - 1].to(torch.float64).sum()
    tau = torch.cat([floor.reshape(1), gains]).cumsum(0)
    n_valid = int(valid.sum())
    rows = b * cfg.floor + torch.arange(n_valid + 1)
    theta = tau[: n_valid + 1] / cost.step_seconds(b, rows)
    budget = int(torch.argmax(theta))
    taken = torch.zeros(b * c, dtype=torch.int32)
    taken[order[:budget]] = 1
    return budget, cfg.floor + taken.reshape(b, c).sum(1, dtype=torch.int32)


def dspark_decision(survival: torch.Tensor, cost: AdditiveCostModel, cfg: ScheduleConfig) -> tuple[int, torch.Tensor]:
    budget = choose_budget(survival, cost, cfg).budget
    return budget, allocate_verify_lens(survival, budget, cfg)


def paired_medians(fn_a, fn_b, repeats: int, block: int = 25) -> tuple[float, float]:
    """Median per-call seconds of two functions timed in alternating blocks of `block` calls.

    Alternating blocks spread load changes on a shared machine over both; calls inside a block run
    back to back, so neither side is timed right after the other has flushed the caches.
    """
    times: tuple[list[float], list[float]] = ([], [])
    for fn in (fn_a, fn_b):
        for _ in range(block):
            fn()
    while len(times[0]) < repeats:
        for fn, out in zip((fn_a, fn_b), times):
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=at_least(1), default=200)
    ap.add_argument("--threads", type=at_least(1), default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--out", type=output_path(), default="perf/results/planner_bench.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cost = bench_cost()
    rows = []
    print(f"{'B':>5} {'gamma':>5} {'dspark us':>10} {'3-argsort us':>13} {'speedup':>8} {'identical':>9}")
    for gamma in GAMMAS:
        cfg = ScheduleConfig(gamma=gamma)
        for b in BATCHES:
            gen = torch.Generator().manual_seed(1000 * gamma + b)
            s = calibrated_survival(torch.randn(b, gamma, generator=gen) * 2 + 2.0)
            ours, base = dspark_decision(s, cost, cfg), baseline_decision(s, cost, cfg)
            same = ours[0] == base[0] and torch.equal(ours[1], base[1])
            t_ours, t_base = paired_medians(lambda: dspark_decision(s, cost, cfg),
                                            lambda: baseline_decision(s, cost, cfg), args.repeats)
            rows.append({"B": b, "gamma": gamma, "dspark_s": t_ours, "baseline_s": t_base,
                         "speedup": t_base / t_ours, "identical": same, "budget": ours[0]})
            print(f"{b:>5} {gamma:>5} {t_ours * 1e6:>10.1f} {t_base * 1e6:>13.1f} {t_base / t_ours:>7.2f}x {str(same):>9}")
    goal = next(r for r in rows if (r["B"], r["gamma"]) == GOAL)
    print(f"goal B={GOAL[0]}, gamma={GOAL[1]}: {goal['speedup']:.2f}x (target >= 3x: "
          f"{'met' if goal['speedup'] >= 3 else 'NOT met'})")
    record = {"benchmark": "planner_bench", "repeats": args.repeats, "threads": args.threads,
              "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
              "load_average": os.getloadavg(), "cost_model": cost.to_dict(), "rows": rows,
              "goal": {"B": GOAL[0], "gamma": GOAL[1], "speedup": goal["speedup"], "target": 3.0}}
    atomic_write_text(args.out, json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    if not all(r["identical"] for r in rows):
        raise SystemExit("decisions differ between dspark and the baseline")


if __name__ == "__main__":
    main()
