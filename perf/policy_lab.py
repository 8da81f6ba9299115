"""Policy lab: replay the shipped trace through every policy, on every cost model, for B = 1 .. 256.

Under greedy decoding a request's drafts, confidences and accepted lengths depend on its prefix alone, so
one recorded trace (dspark/lab/replay/traces/) replays any policy exactly (`dspark.lab.replay.Lab`: the engine's
own scheduler, step and policies; a simulated target; time from a serving cost model the policy and the
simulator both read). Per cost model: a table of simulated steady tok/s per policy and B, adaptive / best
fixed k and / oracle, rows per step, speculation share, tau bias, the planner's measured wall time per
decision against the modelled step; a PNG; JSON. `--variants` adds what calibration buys (head before /
after STS, temperatures x0.5 / x2, uniform survival, the estimator, the oracle), lag 0 / 1 / 2, the lag-0 scan, tiers
on / off, the gate's parts and the policy's host work priced (`dspark.lab.replay.variants.VARIANTS`), on the
first cost model, at B = 1 / 4 / 16 / 64 / 256 up to its `max_requests` (a demo's `serving_cost.json`: 16).

    PYTHONPATH=. python perf/policy_lab.py [--costs cpu-measured,h100-llama8b-fitted,...] [--gamma 3]
        [--batch-sizes 1,2,4,8,16,32,64,128,256] [--variants] [--out perf/results/policy_lab]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from dspark.cost.serving import load_serving_cost, serving_cost_names
from dspark.lab.progress import Progress
from dspark.lab.replay.lab import Lab, serving_queue
from dspark.lab.replay.report import format_table, plot_throughput, ratios, run_summary
from dspark.lab.replay.trace import DEFAULT_TRACE, load_trace
from dspark.lab.replay.variants import VARIANTS, fit_trace_temperatures, variant_lab
from dspark.util.fileio import atomic_write_text
from dspark.util.options import at_least, int_list, output_path

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
VARIANT_BATCHES = (1, 4, 16, 64, 256)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--draft-sha256", default=None,
                    help="refuse a trace recorded with another draft (default: accept the trace's own draft)")
    ap.add_argument("--costs", default=None, help="comma list of serving cost names or .json paths (default: all shipped)")
    ap.add_argument("--gamma", type=at_least(1), default=3)
    ap.add_argument("--batch-sizes", type=int_list(1), default=BATCH_SIZES)
    ap.add_argument("--variants", action="store_true", help="calibration / lag / tier variants on the first cost model")
    ap.add_argument("--out", type=output_path(folder=True), default="perf/results/policy_lab")
    return ap.parse_args(argv)


def batches_priced(batch_sizes, cost) -> list[int]:
    """The batch sizes a serving cost prices (at most its `max_requests`)."""
    return [b for b in batch_sizes if b <= cost.max_requests]


def study(lab: Lab, batch_sizes, policies, bar) -> dict[int, dict[str, dict]]:
    """Every policy at every B: run_summary cells."""
    rows: dict[int, dict[str, dict]] = {}
    for b in batch_sizes:
        queue = serving_queue(lab.trace, b)
        rows[b] = {}
        for name in policies:
            temps = lab.temperatures if name != "adaptive-est" else None
            rows[b][name] = run_summary(lab.run(name, b, queue.ids), temps, queue.measured)
            bar(f"{lab.cost.name} B={b} {name}")
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(1)
    trace = load_trace(args.trace, draft_sha256=args.draft_sha256)
    costs = args.costs.split(",") if args.costs else serving_cost_names()
    temps, fit = fit_trace_temperatures(trace, args.gamma)
    try:  # every error before any study: each cost's draft, width and gamma against the trace's
        models = [load_serving_cost(c, width=args.gamma + 1) for c in costs]
        labs = [Lab(trace, cost, args.gamma, temperatures=temps) for cost in models]
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"--costs: {e}") from None
    for b in args.batch_sizes:
        serving_queue(trace, b)
        for cost in models:
            if b > cost.max_requests:
                raise SystemExit(f"--batch-sizes {b}: serving cost {cost.name!r} prices at most {cost.max_requests} "
                                 f"requests per step; pass batch sizes <= {cost.max_requests} for it")
    variant_batches = batches_priced(VARIANT_BATCHES, models[0])
    policies = [f"fixed-{k}" for k in range(args.gamma + 1)] + ["adaptive", "adaptive-est", "oracle"]
    units = len(models) * len(args.batch_sizes) * len(policies)
    if args.variants:
        units += len(VARIANTS) * len(variant_batches)
    bar = Progress(units, print)
    out: dict = {"trace": {"path": str(args.trace), "sha256": trace.meta.get("sha256"),
                           "draft_sha256": trace.meta.get("draft_sha256"), "summary": trace.summary()},
                 "gamma": args.gamma, "temperatures": temps, "sts_fit": fit, "policies": policies,
                 "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__},
                 "what_if": "acceptance from the 135M SmolLM2 pair; on the 8B cost models a what-if",
                 "cost_models": {}}
    folder = Path(args.out)
    tables, plots = [], []
    for cost, lab in zip(models, labs):
        t0 = time.perf_counter()
        rows = study(lab, args.batch_sizes, policies, bar)
        seconds = time.perf_counter() - t0
        out["cost_models"][cost.name] = {"platform": cost.platform, "replay_seconds": seconds,
                                         "cells": {str(b): r for b, r in rows.items()},
                                         "ratios": {str(b): ratios(r) for b, r in rows.items()}}
        tables.append(format_table(cost.name, rows, policies) + f"\n(replayed in {seconds:.1f} s)")
        plots.append((cost.name, rows))
    if args.variants:
        base = Lab(trace, models[0], args.gamma, temperatures=temps)  # fresh online estimators, not the study's
        cells: dict = {}
        for name in VARIANTS:
            for b in variant_batches:
                queue = serving_queue(trace, b)
                lab, policy = variant_lab(base, name, b, queue.ids)
                cells.setdefault(name, {})[str(b)] = run_summary(lab.run(policy, b, queue.ids),
                                                                lab.temperatures if name != "estimator" else None,
                                                                queue.measured)
                bar(f"variant {name} B={b}")
        out["variants"] = {"cost_model": models[0].name, "cells": cells}
        head = "variant (tok/s over the queue)  " + "  ".join(f"B={b:>6}" for b in variant_batches)
        tables.append("\n".join([f"variants on {models[0].name}", head] + [
            f"{name:<22}  " + "  ".join(f"{cells[name][str(b)]['tok_s']:>8.1f}" for b in variant_batches)
            for name in VARIANTS]))
    out["seconds"] = time.perf_counter() - t_start
    folder.mkdir(parents=True, exist_ok=True)  # written only once every study ran
    for name, rows in plots:
        plot_throughput(name, rows, policies, folder / f"{name}.png")
    atomic_write_text(folder / "policy_lab.json", json.dumps(out, indent=1))
    print("\n\n".join(tables))
    print(f"wrote {folder}/policy_lab.json and a PNG per cost model in {out['seconds']:.0f} s")
    return out


if __name__ == "__main__":
    main()
