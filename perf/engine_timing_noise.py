"""How noisy are the engine's step timings on this machine, and what does `lockstep` buy?

The same run (a policy over the demo's continuous-batching queue at one B, thread CPU time) is timed:
  back to back   `--repeats` runs one after another: the spread of steady-state tokens/s between them
                 is what a policy comparison made of sequential runs has to beat;
  A/A lockstep   two identical runs on forked decoders, interleaved step by step, `--repeats` rounds: the
                 spread of their per-round ratio (ideally 1.0) is the resolution of the demo's comparisons.
Prints both and writes perf/results/engine_timing_noise.json.

    PYTHONPATH=. python perf/engine_timing_noise.py [--batch 4] [--k 5] [--repeats 8]
"""
from __future__ import annotations

import argparse
import platform
import statistics

import torch

from dspark.lab.demo.config import request_lengths
from dspark.lab.demo.models import load_models
from dspark.lab.timing import lockstep
from dspark.models.corpus import prompt_windows
from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import FixedK
from dspark.util.fileio import write_json_atomic
from dspark.util.options import at_least, output_path


def _steady(res) -> float:
    tokens, seconds = res.steady()
    return tokens / seconds


def _spread(xs: list[float]) -> dict:
    med = statistics.median(xs)
    return {"values": xs, "median": med, "min_over_max": min(xs) / max(xs), "half_range": (max(xs) - min(xs)) / 2 / med}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=at_least(1), default=4)
    ap.add_argument("--k", type=at_least(0), default=5, help="fixed-k policy timed")
    ap.add_argument("--repeats", type=at_least(1), default=8)
    ap.add_argument("--out", type=output_path(), default="perf/results/engine_timing_noise.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target, draft, encode = load_models(torch.device("cpu"))
    b = args.batch
    base = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=b * 256, clock="thread"))
    twins = (base.fork(), base.fork())
    queue = prompt_windows("heldout", encode, 3 * b, 32, 0)
    counts = request_lengths(3 * b, 32, 0.5, 0)
    for dec in (base, *twins):  # warm-up
        dec.generate(queue, counts, FixedK(args.k), max_batch=b)
    sequential = [_steady(base.generate(queue, counts, FixedK(args.k), max_batch=b)) for _ in range(args.repeats)]
    ratios = []
    for _ in range(args.repeats):
        res = lockstep({i: d.start(queue, counts, FixedK(args.k), max_batch=b) for i, d in enumerate(twins)})
        ratios.append(_steady(res[0]) / _steady(res[1]))
    seq, aa = _spread(sequential), _spread(ratios)
    print(f"B={b} fixed-{args.k}, {args.repeats} repeats, thread CPU time")
    print(f"  back to back: steady tok/s {min(sequential):.0f}-{max(sequential):.0f} (median {seq['median']:.0f}; "
          f"slowest / fastest {seq['min_over_max']:.2f}, half range {100 * seq['half_range']:.0f} %)")
    print(f"  A/A lockstep: per-round ratio {min(ratios):.3f}-{max(ratios):.3f} (median {aa['median']:.3f}, "
          f"half range {100 * aa['half_range']:.0f} %)")
    write_json_atomic(args.out, {
        "command": f"PYTHONPATH=. python perf/engine_timing_noise.py --batch {b} --k {args.k} --repeats {args.repeats}",
        "platform": platform.platform(), "torch": torch.__version__, "threads": 1, "clock": "thread",
        "back_to_back_steady_tokens_per_s": seq, "aa_lockstep_ratio": aa})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
