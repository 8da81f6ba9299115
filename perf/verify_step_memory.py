"""Resident memory a captured SmolLM2 verify step adds on the CPU: one `VerifyStepAdapter` (its KV cache and
every tier of the demo's ladder captured) built, then two steps run; RSS before and after, in MiB.

    PYTHONPATH=. python perf/verify_step_memory.py [--batch 16] [--width 7] [--context 64]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

from dspark.lab.sweep import SweepCache, VerifyStepAdapter
from dspark.serve.tier_step import VerifyStepShape
from dspark.util.fileio import atomic_write_text
from dspark.util.options import at_least, output_path
from dspark.verify.layout import tier_ladder


def rss_mib() -> float:
    """This process's resident set size (Linux /proc)."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=at_least(1), default=16)
    ap.add_argument("--width", type=at_least(2), default=7)
    ap.add_argument("--context", type=at_least(1), default=64)
    ap.add_argument("--out", type=output_path(), default="perf/results/verify_step_memory.json")
    args = ap.parse_args(argv)
    from dspark.models import load_smollm2

    torch.set_num_threads(1)
    target, _ = load_smollm2()
    tiers = tier_ladder(sorted({1, 4, args.batch}), args.width)
    before = rss_mib()
    step = VerifyStepAdapter(target, VerifyStepShape(tiers, args.width, args.batch), SweepCache(args.context))
    captured = rss_mib()
    for b, rows in ((args.batch, args.batch * args.width // 2), (max(1, args.batch // 4), args.batch)):
        step.prepare(b, rows)
        step.step()
    stepped = rss_mib()
    cache_mib = sum(t.numel() * t.element_size() for t in (step.cache.k, step.cache.v)) / 2 ** 20
    out = {"command": "PYTHONPATH=. python perf/verify_step_memory.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "tiers": list(tiers), "kv_cache_mib": round(cache_mib, 1), "rss_before_mib": round(before),
           "after_capture_mib": round(captured - before), "after_two_steps_mib": round(stepped - before)}
    print(json.dumps(out))
    atomic_write_text(args.out, json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
