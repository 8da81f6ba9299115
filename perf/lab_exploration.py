"""What the adaptive policy's speculative steps cost where plain decoding wins, step by step.

Replays the shipped trace (`dspark.lab.replay.Lab`, as `perf/policy_lab.py`: the same queue and measure) with
`fixed-0` and `adaptive` at each B on one cost model and, over the steps where every slot is busy, counts the
speculative steps, the seconds they took beyond a plain step over the same requests (priced by the same rules:
`ServingCost.price` at the step's own KV tokens), the tokens they committed beyond one per request, and the
tokens plain decoding would have made in those extra seconds (at the plain run's tok/s). Prints a table,
writes JSON.

    PYTHONPATH=. python perf/lab_exploration.py [--cost cpu-measured] [--batch-sizes 8,16,32] [--gamma 3] [--lag 0]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from dspark.cost.serving import StepWork, load_serving_cost
from dspark.lab.replay.lab import Lab, serving_queue
from dspark.lab.replay.report import run_summary
from dspark.lab.replay.trace import DEFAULT_TRACE, load_trace
from dspark.lab.replay.variants import fit_trace_temperatures
from dspark.util.fileio import atomic_write_text
from dspark.util.options import at_least, int_list, output_path


def window(result, b: int, cost) -> dict:
    """The full-batch steps of one run: counts, speculative steps and their extra seconds / tokens over a plain
    step of the same requests."""
    full = [s for s in result.steps if s.requests.numel() == b]
    spec = [s for s in full if s.speculated]
    return {"full_steps": len(full), "speculative_steps": len(spec),
            "first_speculative_steps": [i for i, s in enumerate(result.steps) if s.speculated][:8],
            "extra_seconds": sum(s.times.total - s.times.prefill - cost.price(StepWork(b, b, s.kv_tokens))
                                 for s in spec),
            "extra_tokens": sum(float(s.commit_lens.sum()) - b for s in spec)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cost", default="cpu-measured", help="a shipped serving cost name or a .json path")
    ap.add_argument("--gamma", type=at_least(1), default=3)
    ap.add_argument("--batch-sizes", type=int_list(1), default=(8, 16, 32))
    ap.add_argument("--lag", type=at_least(0), default=0, help="the planner's lag (0: the synchronous greedy scan)")
    ap.add_argument("--out", type=output_path(), default="perf/results/lab_exploration.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    trace = load_trace(DEFAULT_TRACE)
    cost = load_serving_cost(args.cost, width=args.gamma + 1)
    for b in args.batch_sizes:
        serving_queue(trace, b)
    temps, _ = fit_trace_temperatures(trace, args.gamma)
    lab = Lab(trace, cost, args.gamma, temperatures=temps, lag=args.lag)
    rows = []
    print(f"{'B':>4} {'full steps':>10} {'spec':>5} {'extra s':>8} {'extra tok':>9} {'plain tok in extra s':>20} "
          f"{'adaptive / plain':>16}")
    for b in args.batch_sizes:
        q = serving_queue(trace, b)
        plain = run_summary(lab.run("fixed-0", b, q.ids), None, q.measured)["tok_s"]
        adaptive = lab.run("adaptive", b, q.ids)
        w = window(adaptive, b, cost)
        w.update(batch=b, plain_tok_s=plain, plain_tokens_in_extra_seconds=w["extra_seconds"] * plain,
                 adaptive_tok_s=run_summary(adaptive, temps, q.measured)["tok_s"])
        rows.append(w)
        print(f"{b:>4} {w['full_steps']:>10} {w['speculative_steps']:>5} {w['extra_seconds']:>8.2f} "
              f"{w['extra_tokens']:>9.0f} {w['plain_tokens_in_extra_seconds']:>20.0f} "
              f"{w['adaptive_tok_s'] / w['plain_tok_s']:>16.3f}")
    out = {"command": "PYTHONPATH=. python perf/lab_exploration.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "trace_sha256": trace.meta.get("sha256"), "cost": args.cost, "gamma": args.gamma, "lag": args.lag,
           "rows": rows,
           "seconds": round(time.perf_counter() - t0, 1)}
    atomic_write_text(args.out, json.dumps(out, indent=1))
    print(f"wrote {args.out} in {out['seconds']} s")
    return out


if __name__ == "__main__":
    main()
