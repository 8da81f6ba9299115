"""Replay vs live: the trace replay's predicted tok/s against the live engine's measured tok/s, cell by cell.

The same queue of trace requests is served live (SmolLM2 + the shipped draft on this CPU, `SpecDecoder`, the
cost model's graph tiers, one thread, thread clock) and replayed (`dspark.replay.Lab`), every policy built by
the same factory with planners over the same serving cost model (default `cpu-measured`). Per (policy, B):
the step-by-step agreement of live and replay (`dspark.replay.live.step_agreement`), the live steady tok/s
(with and without prefill, medians over lockstep rounds), the replay's, and the cost model's error on the
live run's own steps (`priced_steady`), which accounts for the gap when the steps agree. JSON and a PNG.

    PYTHONPATH=. python perf/replay_live.py [--model real|tiny] [--batch-sizes 1,4,16] [--min-requests 8]
        [--repeats 2] [--cost cpu-measured] [--out perf/results/replay_live.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from dspark.cli.options import at_least, int_list, output_path
from dspark.config import VerifyMode
from dspark.cost.serving import ServingCost, load_serving_cost
from dspark.engine.decode import SpecDecoder
from dspark.engine.lockstep import lockstep
from dspark.engine.progress import Progress
from dspark.engine.results import GenerateResult
from dspark.replay.lab import Lab, queue_ids
from dspark.replay.live import priced_steady, step_agreement
from dspark.replay.trace import Trace
from dspark.replay.variants import fit_trace_temperatures
from dspark.util.fileio import write_json_atomic

POLICIES = ("fixed-0", "fixed-1", "fixed-2", "fixed-3", "adaptive", "adaptive-est")  # the oracle cannot run live
GOAL = 0.05


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("real", "tiny"), default="real", help="tiny: the tests' models (a smoke run)")
    ap.add_argument("--cost", default="cpu-measured", help="a shipped serving cost name or a .json path")
    ap.add_argument("--gamma", type=at_least(1), default=3)
    ap.add_argument("--batch-sizes", type=int_list(1), default=(1, 4, 16))
    ap.add_argument("--min-requests", type=at_least(1), default=8, help="queue length at least (2 per slot)")
    ap.add_argument("--repeats", type=at_least(1), default=2, help="timed lockstep rounds per B")
    ap.add_argument("--out", type=output_path(), default="perf/results/replay_live.json")
    return ap.parse_args(argv)


def setup(args: argparse.Namespace, tiers: tuple[int, ...]) -> tuple[SpecDecoder, Trace, dict[int, Tensor], str]:
    """(a decoder over the target and draft with the graph tiers `tiers` and a KV cache for the largest B of
    the trace's longest requests, the trace recorded with them, each B's queue of trace requests, a
    description). The real trace's queues are checked before the models load."""
    def queues(trace: Trace) -> dict[int, Tensor]:
        return {b: queue_ids(trace, b, min_requests=args.min_requests) for b in args.batch_sizes}

    gamma = args.gamma
    if args.model == "real":
        from dspark.engine.demo import load_models
        from dspark.models.draft import DEFAULT_WEIGHTS, file_sha256
        from dspark.replay.trace import DEFAULT_TRACE, load_trace

        trace = load_trace(DEFAULT_TRACE, draft_sha256=file_sha256(DEFAULT_WEIGHTS))
        queues(trace)
        target, draft, _ = load_models(torch.device("cpu"))
        what = "SmolLM2-135M-Instruct"
    else:
        root = str(Path(__file__).resolve().parents[1])
        if root not in sys.path:
            sys.path.insert(0, root)
        from dspark.replay.record import record_trace
        from dspark.replay.workload import Request
        from tests.engine_models import VOCAB, tiny_models

        target, draft = tiny_models(gamma=gamma)
        g = torch.Generator().manual_seed(7)
        requests = [Request(("code", "chat", "copy")[i % 3], torch.randint(3, VOCAB, (int(p),), generator=g), int(n))
                    for i, (p, n) in enumerate(zip(torch.randint(4, 9, (24,), generator=g),
                                                   torch.randint(3, 12, (24,), generator=g)))]
        trace = record_trace(target, draft, requests, draft_sha256="0" * 64, gamma=gamma, max_batch=4)
        what = "the tests' tiny Llama"
    per_request = int(trace.prompt_lens.max() + trace.new_tokens.max()) + 2 * (gamma + 1) + 64 + 16  # catch-up rows, a page
    decoder = SpecDecoder(target, draft, cache_tokens=max(args.batch_sizes) * per_request, tiers=tiers, clock="thread")
    return decoder, trace, queues(trace), what


def cell(live: list[GenerateResult], sim: GenerateResult, trace: Trace, ids: Tensor, cost: ServingCost) -> dict:
    """One (policy, B): agreement of the first live round with the replay, live and replayed tok/s, the cost
    model's error on the live steps (medians over rounds)."""
    priced = [priced_steady(r, cost) for r in live]
    replay_tok, replay_seconds = sim.steady()
    replay = replay_tok / replay_seconds if replay_seconds > 0 else 0.0
    med = {k: statistics.median(p[k] for p in priced) for k in ("tok_s", "tok_s_no_prefill", "priced_tok_s")}
    errors = {part: statistics.median(p[part]["cost_error"] for p in priced) if priced[0][part]["steps"] else None
              for part in ("all", "speculative", "plain")}
    return {"agreement": step_agreement(live[0], sim, trace, ids),
            "live_tok_s_runs": [p["tok_s"] for p in priced], "live_tok_s": med["tok_s"],
            "live_tok_s_no_prefill": med["tok_s_no_prefill"], "live_priced_tok_s": med["priced_tok_s"],
            "replay_tok_s": replay, "gap": replay / med["tok_s"] - 1.0,
            "gap_no_prefill": replay / med["tok_s_no_prefill"] - 1.0,
            "replay_vs_priced_live": replay / med["priced_tok_s"] - 1.0,
            "cost_error": errors, "prefill_share": statistics.median(p["prefill_s"] / (p["all"]["measured_s"] +
                                                                                        p["prefill_s"]) for p in priced),
            "steady_steps": priced[0]["steps"]}


def plot(cells: dict, path: Path) -> bool:
    """Replayed vs live steady tok/s, one point per (policy, B), the y = x line and the +-5 % band."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    top = 0.0
    for b, row in cells.items():
        xs = [c["live_tok_s"] for c in row.values()]
        ys = [c["replay_tok_s"] for c in row.values()]
        ax.scatter(xs, ys, label=f"B = {b}")
        for name, x, y in zip(row, xs, ys):
            ax.annotate(name, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
        top = max(top, *xs, *ys)
    line = [0.0, top * 1.1]
    ax.plot(line, line, "k-", lw=0.8, label="replay = live")
    ax.fill_between(line, [v * (1 - GOAL) for v in line], [v * (1 + GOAL) for v in line], color="grey", alpha=0.2,
                    label="+-5 %")
    ax.set_xlabel("live steady tok/s (measured, prefill included)")
    ax.set_ylabel("replayed steady tok/s (cost model)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    cost = load_serving_cost(args.cost, width=args.gamma + 1)
    decoder, trace, queues, what = setup(args, tuple(cost.tiers))
    temps, _ = fit_trace_temperatures(trace, args.gamma)
    lab = Lab(trace, cost, args.gamma, temperatures=temps)
    bar = Progress(len(args.batch_sizes) * (2 * len(POLICIES) + args.repeats), print)
    cells: dict = {}
    for b, ids in queues.items():
        # forks per B, released after: a decoder keeps a captured step, with buffers for every tier, per B it ran
        decoders = {name: decoder.fork() for name in POLICIES}
        prompts = [trace.prompt(int(i)) for i in ids]
        counts = trace.new_tokens[ids].clone()
        for name in POLICIES:  # untimed warm-up: the first steps at new shapes are slow
            decoders[name].generate(prompts[:b], 2, lab.policy(name, b), max_batch=b)
            bar(f"B={b} warm-up {name}")
        rounds: dict[str, list] = {name: [] for name in POLICIES}
        for rep in range(args.repeats):
            order = list(POLICIES[rep % len(POLICIES):] + POLICIES[: rep % len(POLICIES)])
            labs = {name: dataclasses.replace(lab, estimators={}) for name in order}  # a fresh estimator per run
            runs = lockstep({name: decoders[name].start(prompts, counts, labs[name].policy(name, b),
                                                        mode=VerifyMode.COMPACT, max_batch=b) for name in order})
            for name in POLICIES:
                rounds[name].append(runs[name])
            bar(f"B={b} live round {rep + 1}/{args.repeats}")
        cells[b] = {}
        for name in POLICIES:
            sim = dataclasses.replace(lab, estimators={}).run(name, b, ids)
            cells[b][name] = cell(rounds[name], sim, trace, ids, cost)
            bar(f"B={b} replay {name}")
        del decoders, rounds
    out = {"command": "PYTHONPATH=. python perf/replay_live.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": what, "cost_model": cost.name, "gamma": args.gamma, "temperatures": temps,
           "queues": {str(b): ids.tolist() for b, ids in queues.items()}, "repeats": args.repeats,
           "tiers": list(decoder.tiers), "goal": GOAL,
           "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": 1, "clock": "thread"},
           "cells": {str(b): row for b, row in cells.items()}}
    out["within_goal"] = sum(abs(c["gap"]) <= GOAL for row in cells.values() for c in row.values())
    out["cells_total"] = sum(len(row) for row in cells.values())
    out["seconds"] = time.perf_counter() - t0
    path = Path(args.out)
    write_json_atomic(path, out)
    plot(cells, path.with_suffix(".png"))
    print(f"{'B':>4} {'policy':>13} {'steps same':>11} {'diverged':>9} {'live tok/s':>11} {'no prefill':>11} "
          f"{'replay':>8} {'gap':>7} {'cost err':>9} {'vs priced':>10}")
    for b, row in cells.items():
        for name, c in row.items():
            a = c["agreement"]
            print(f"{b:>4} {name:>13} {a['identical']:>5}/{a['compared']:<5} {a['diverging_requests']:>9} "
                  f"{c['live_tok_s']:>11.2f} {c['live_tok_s_no_prefill']:>11.2f} {c['replay_tok_s']:>8.2f} "
                  f"{c['gap']:>+7.1%} {c['cost_error']['all']:>+9.1%} {c['replay_vs_priced_live']:>+10.1%}")
    print(f"{out['within_goal']}/{out['cells_total']} cells within {GOAL:.0%}; wrote {path} and "
          f"{path.with_suffix('.png')} in {out['seconds']:.0f} s")
    return out


if __name__ == "__main__":
    main()
