"""The draft phase against the requests' context: does the drafter's step cost grow with the tokens it holds?

The same-run serving profile (`dspark.lab.serving_profile.profile_drafting`) times the draft phase on its
32-token prompts and prices no draft KV term, where the trace's requests hold about 120 tokens. Here the demo's
models (SmolLM2-135M and the shipped draft) run that same measurement, B requests drafting k tokens and verifying
the roots only (`ForcedRows(k, B, B)`), on held-out prompts of `--short` and of `--long` tokens, the two runs
advanced in lockstep (`dspark.lab.timing`, thread CPU time), `--repeats` pairs. Per (B, k): the median over the
pairs of each run's median full-batch draft phase, long / short, and the extra seconds per extra cached token; and
the first step's draft phase, whose drafter catches up the admitted prompts (the profile prices that catch-up per
token at the slope it fits over its catch-up runs' steps, the first's prompts included): its extra seconds per
extra token caught up.

    PYTHONPATH=. python perf/draft_context.py [--batch-sizes 1,4,16] [--short 32] [--long 160] [--repeats 3] \
        [--out perf/results/draft_context.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from dspark.lab.demo.models import load_models
from dspark.lab.profile import ForcedRows
from dspark.lab.progress import Progress
from dspark.lab.timing import lockstep
from dspark.models.corpus import prompt_windows
from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.util.fileio import atomic_write_text
from dspark.util.options import at_least, int_list, output_path

TOKENS = 12  # new tokens per run: the serving profile's run length


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int_list(1), default=(1, 4, 16))
    ap.add_argument("--gamma", type=at_least(1), default=3)
    ap.add_argument("--short", type=at_least(2), default=32, help="prompt tokens of the short runs (the profile's)")
    ap.add_argument("--long", type=at_least(3), default=160, help="prompt tokens of the long runs")
    ap.add_argument("--repeats", type=at_least(1), default=3, help="lockstep short / long pairs per (B, k)")
    ap.add_argument("--out", type=output_path(), default="perf/results/draft_context.json")
    args = ap.parse_args(argv)
    if args.long <= args.short:
        ap.error(f"--long must exceed --short ({args.short}), got {args.long}")
    return args


def draft_phase(res, b: int) -> tuple[float, float, float, int]:
    """(median draft seconds, mean cached tokens per request) over a run's full-batch steps, then the first
    step's draft seconds and tokens caught up beyond the roots (the admitted prompts)."""
    full = [s for s in res.steps if s.requests.numel() == b]
    first = res.steps[0]
    return (statistics.median(s.times.draft for s in full), statistics.fmean(s.kv_tokens for s in full) / b,
            first.times.draft, int(first.catch_up))


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    target, draft, encode = load_models(torch.device("cpu"))
    top = max(args.batch_sizes)
    prompts = {n: prompt_windows("heldout", encode, top, n, 0) for n in (args.short, args.long)}
    cache = top * (args.long + TOKENS + 2 * (args.gamma + 1) + 16)
    decoder = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=cache, clock="thread"))
    bar = Progress(len(args.batch_sizes) * args.gamma, print)
    cells: dict = {}
    for b in args.batch_sizes:
        for k in range(1, args.gamma + 1):
            pairs = []
            for r in range(args.repeats + 1):  # pair 0: warm-up, not kept
                runs = {n: decoder.fork().start(p[:b], TOKENS, ForcedRows(k, b, b)) for n, p in prompts.items()}
                done = lockstep(runs)
                if r:
                    pairs.append({n: draft_phase(res, b) for n, res in done.items()})
            short = statistics.median(x[args.short][0] for x in pairs)
            long = statistics.median(x[args.long][0] for x in pairs)
            extra_tokens = statistics.fmean(x[args.long][1] - x[args.short][1] for x in pairs) * b
            first = {n: statistics.median(x[n][2] for x in pairs) for n in prompts}
            caught = {n: statistics.fmean(x[n][3] for x in pairs) for n in prompts}
            cells[f"k={k}@{b}"] = {"short_ms": 1e3 * short, "long_ms": 1e3 * long, "ratio": long / short,
                                   "cached_tokens": {n: statistics.fmean(x[n][1] for x in pairs) for n in prompts},
                                   "us_per_extra_token": 1e6 * (long - short) / extra_tokens,
                                   "first_step_ms": {n: 1e3 * v for n, v in first.items()}, "caught_up": caught,
                                   "first_step_us_per_extra_token": 1e6 * (first[args.long] - first[args.short])
                                   / (caught[args.long] - caught[args.short])}
            bar(f"B={b} k={k}")
    print(f"{'k@B':>8} {'short ms':>9} {'long ms':>8} {'long/short':>10} {'us / extra token':>17} "
          f"{'first step short / long ms':>27} {'us / token caught up':>21}")
    for key, c in cells.items():
        f = c["first_step_ms"]
        print(f"{key:>8} {c['short_ms']:>9.2f} {c['long_ms']:>8.2f} {c['ratio']:>10.3f} "
              f"{c['us_per_extra_token']:>17.2f} {f[args.short]:>13.2f} / {f[args.long]:<11.2f} "
              f"{c['first_step_us_per_extra_token']:>21.2f}")
    out = {"command": "PYTHONPATH=. python perf/draft_context.py", "args": vars(args) | {
               "batch_sizes": list(args.batch_sizes)},
           "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": 1, "clock": "thread"},
           "cells": cells, "seconds": time.perf_counter() - t_start}
    atomic_write_text(args.out, json.dumps(out, indent=1))
    print(f"wrote {args.out} in {out['seconds']:.0f} s")
    return out


if __name__ == "__main__":
    main()
