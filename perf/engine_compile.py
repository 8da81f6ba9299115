"""The verify step with and without `compile_model` on the CPU: compile time and per-tier speed-up.

For two random Llama configs (transformers' own model code, attention through dspark's planned path):
the time to build a `VerifyStep` and run its first step at every tier (eager, and with `compile_model=True`,
which compiles at those first forwards: the difference is the compile time), then per tier the median step
time of each and their ratio, and the largest logit difference between them.

    PYTHONPATH=. python perf/engine_compile.py [--repeats 30] [--threads 1] [--out perf/results/engine_compile.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from dspark.lab.sweep import SweepCache, VerifyStepAdapter
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve.tier_step import VerifyStepShape
from dspark.util.fileio import atomic_write_text
from dspark.util.options import at_least, output_path

TIERS = (8, 32, 64)
WIDTH, REQUESTS, CONTEXT = 8, 8, 64
MODELS = {"tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 64},
          "small": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
                    "num_key_value_heads": 2, "vocab_size": 2048}}


def target(name: str) -> TransformersCausalLM:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(**MODELS[name], max_position_embeddings=256, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    return TransformersCausalLM(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval())


def build(name: str, compile_model: bool) -> tuple[VerifyStepAdapter, float]:
    t0 = time.perf_counter()
    adapter = VerifyStepAdapter(target(name), VerifyStepShape(TIERS, WIDTH, REQUESTS), SweepCache(CONTEXT, seed=1),
                                compile_model=compile_model)
    for tier in TIERS:  # the first forward at each tier (a compiled model compiles in them)
        adapter.prepare(REQUESTS, max(REQUESTS, tier - 1))
        adapter.step()
    return adapter, time.perf_counter() - t0


def step_time(adapter: VerifyStepAdapter, rows: int, repeats: int) -> tuple[float, torch.Tensor]:
    adapter.prepare(REQUESTS, rows)
    logits = adapter.verify(*adapter._step).logits.clone()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        adapter.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=at_least(1), default=30)
    ap.add_argument("--threads", type=at_least(1), default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--out", type=output_path(), default="perf/results/engine_compile.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows_out = []
    print(f"{'model':>6} {'tier':>5} {'eager ms':>9} {'compiled ms':>12} {'speed-up':>9} {'max |dlogit|':>13}")
    models = []
    for name, shape in MODELS.items():
        (eager, t_eager), (compiled, t_compiled) = build(name, False), build(name, True)
        models.append({"model": name, **shape, "build_eager_s": t_eager, "build_compiled_s": t_compiled,
                       "compile_s": t_compiled - t_eager})
        print(f"{name}: build eager {t_eager:.1f} s, with compile_model {t_compiled:.1f} s "
              f"(compile {t_compiled - t_eager:.1f} s for {len(TIERS)} tiers; both with a first step per tier)")
        for tier in TIERS:
            rows = max(REQUESTS, tier - 1)
            (a, la), (b, lb) = step_time(eager, rows, args.repeats), step_time(compiled, rows, args.repeats)
            diff = float((la - lb).abs().max())
            rows_out.append({"model": name, "tier": tier, "rows": rows, "eager_s": a, "compiled_s": b,
                             "speedup": a / b, "max_abs_logit_diff": diff})
            print(f"{name:>6} {tier:>5} {a * 1e3:>9.2f} {b * 1e3:>12.2f} {a / b:>8.2f}x {diff:>13.2e}")
    record = {"benchmark": "engine_compile", "device": "cpu", "repeats": args.repeats, "threads": args.threads,
              "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
              "load_average": os.getloadavg(), "tiers": list(TIERS), "width": WIDTH, "requests": REQUESTS,
              "context": CONTEXT, "models": models, "rows": rows_out}
    atomic_write_text(args.out, json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
