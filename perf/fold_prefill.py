"""Chunked prefill on and off, live on this machine: what folding a refill's prompt into the next step's forward
(`EngineConfig.fold_prefill`) does to a continuous-batching queue.

SmolLM2-135M and its shipped draft (the demo's models) serve a queue of the shipped trace's prompts (the last
`--prompt-len` tokens of each, as long as the demo's), N = B x `--requests-per-slot`, each request cut at
`--max-new-tokens`, on B slots, with each fixed k: one decoder that
folds and one that prefills every admission in a forward of its own, each run advanced in lockstep with the
others (`dspark.lab.timing`, thread CPU time), `--repeats` rounds. Per (B, k): the whole queue's tokens / its
seconds for each, and fold / apart as the median of the rounds' ratios with their range; the same for the
steps with every slot busy. The tokens of both runs are compared (they must be equal: greedy decoding).

    PYTHONPATH=. python perf/fold_prefill.py [--batch-sizes 4,16] [--ks 0,1] [--repeats 2] \
        [--out perf/results/fold_prefill.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from dspark.lab.demo.models import load_models
from dspark.lab.progress import Progress
from dspark.lab.replay.lab import queue_ids
from dspark.lab.replay.trace import load_trace
from dspark.lab.timing import lockstep
from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import FixedK
from dspark.util.fileio import atomic_write_text
from dspark.util.options import at_least, int_list, output_path


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int_list(1), default=(4, 16))
    ap.add_argument("--ks", type=int_list(0), default=(0, 1))
    ap.add_argument("--prompt-len", type=at_least(2), default=32)
    ap.add_argument("--requests-per-slot", type=at_least(2), default=3)
    ap.add_argument("--max-new-tokens", type=at_least(1), default=24)
    ap.add_argument("--repeats", type=at_least(1), default=2)
    ap.add_argument("--out", type=output_path(), default="perf/results/fold_prefill.json")
    return ap.parse_args(argv)


def rates(res) -> tuple[float, float]:
    """(whole-queue tok/s, tok/s over the steps with every slot busy) of one run."""
    tokens = int(res.num_tokens.sum())
    steady_tokens, steady_seconds = res.steady()
    return tokens / res.seconds, steady_tokens / steady_seconds if steady_seconds > 0 else 0.0


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    target, draft, _ = load_models(torch.device("cpu"))
    trace = load_trace()
    gamma = max(args.ks)
    longest = args.prompt_len + args.max_new_tokens + gamma + 1
    cache = max(args.batch_sizes) * (longest + 16)
    folding = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=cache, clock="thread"))
    apart = folding.fork(fold_prefill=False)
    bar = Progress(len(args.batch_sizes) * (args.repeats + 1), print)
    cells: dict = {}
    for b in args.batch_sizes:
        ids = queue_ids(trace, b * args.requests_per_slot)
        prompts = [trace.prompt(int(i))[-args.prompt_len:] for i in ids]
        counts = trace.new_tokens[ids].clamp(max=args.max_new_tokens).to(torch.int64)
        decoders = {(k, fold): (folding if fold else apart).fork() for k in args.ks for fold in (True, False)}
        rounds: list[dict] = []
        for r in range(args.repeats + 1):  # round 0: warm-up, not kept
            runs = {key: d.start(prompts, counts, FixedK(key[0]), max_batch=b) for key, d in decoders.items()}
            done = lockstep(runs)
            for k in args.ks:
                if not torch.equal(done[(k, True)].tokens, done[(k, False)].tokens):
                    raise AssertionError(f"fixed-{k} at B = {b}: folding changed the tokens")
            if r:
                rounds.append({key: rates(res) for key, res in done.items()})
            bar(f"B={b} round {r}/{args.repeats}" + (" (warm-up)" if not r else ""))
        for k in args.ks:
            ratio = [x[(k, True)][0] / x[(k, False)][0] for x in rounds]
            steady = [x[(k, True)][1] / x[(k, False)][1] for x in rounds]
            cells[f"fixed-{k}@{b}"] = {
                "queue_tok_s": {"fold": statistics.median(x[(k, True)][0] for x in rounds),
                                "apart": statistics.median(x[(k, False)][0] for x in rounds)},
                "steady_tok_s": {"fold": statistics.median(x[(k, True)][1] for x in rounds),
                                 "apart": statistics.median(x[(k, False)][1] for x in rounds)},
                "queue_ratio": statistics.median(ratio), "queue_ratio_range": [min(ratio), max(ratio)],
                "steady_ratio": statistics.median(steady), "steady_ratio_range": [min(steady), max(steady)]}
    print(f"{'policy@B':>12} {'queue fold':>11} {'apart':>8} {'ratio':>7} {'range':>13} {'steady ratio':>13}")
    for key, c in cells.items():
        lo, hi = c["queue_ratio_range"]
        print(f"{key:>12} {c['queue_tok_s']['fold']:>11.2f} {c['queue_tok_s']['apart']:>8.2f} "
              f"{c['queue_ratio']:>7.3f} {lo:>6.3f}-{hi:<6.3f} {c['steady_ratio']:>13.3f}")
    out = {"command": "PYTHONPATH=. python perf/fold_prefill.py", "args": {k: (list(v) if isinstance(v, tuple) else v)
                                                                             for k, v in vars(args).items()},
           "machine": {"platform": platform.platform(), "torch": torch.__version__}, "cells": cells,
           "seconds": time.perf_counter() - t_start}
    atomic_write_text(args.out, json.dumps(out, indent=1, default=str))
    print(f"wrote {args.out} in {out['seconds']:.0f} s")
    return out


if __name__ == "__main__":
    main()
