"""The CPU attention of a step that carries a folded prompt: every slot padded to the longest query (one
group, what the torch path did before it grouped slots) against the plan's slot groups (`group_slots`).

One layer of SmolLM2-135M's attention (9 query heads, 3 KV heads, head dim 64, float32, 1 thread, page 16):
B verify slots of W rows each over a committed prefix of P tokens, plus one prompt of N rows at position 0
(the refill a folded step carries; N = 0: no prompt). Both plans run the same `RaggedVerifyAttention` plan's
metadata, alternated, `--repeats` times; the table gives the median microseconds per call of each, their
ratio, and the largest difference between their outputs (they must agree to float32 rounding).

    PYTHONPATH=. python perf/fold_attention.py [--batch-sizes 4,16] [--prompts 0,32,120] \
        [--out perf/results/fold_attention.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from dspark import AttentionShape, RaggedVerifyAttention, RaggedVerifyLayout
from dspark.kernels import attention_ref
from dspark.util.fileio import atomic_write_text
from dspark.util.options import at_least, int_list, output_path

HEADS = dict(hq=9, hkv=3, d=64)  # SmolLM2-135M
PAGE = 16


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int_list(1), default=(4, 16))
    ap.add_argument("--prompts", type=int_list(0), default=(0, 32, 120))
    ap.add_argument("--width", type=at_least(1), default=4, help="verify rows per slot (W)")
    ap.add_argument("--prefix", type=at_least(0), default=200, help="committed tokens per verify slot (P)")
    ap.add_argument("--repeats", type=at_least(1), default=30)
    ap.add_argument("--out", type=output_path(), default="perf/results/fold_attention.json")
    return ap.parse_args(argv)


def step(b: int, prompt: int, width: int, prefix: int) -> dict:
    """A planned step: b slots of `width` rows over `prefix` tokens, then a prompt of `prompt` rows."""
    gen = torch.Generator().manual_seed(b * 1009 + prompt)
    lens = [width] * b + ([prompt] if prompt else [])
    prefixes = [prefix] * b + ([0] if prompt else [])
    pages = [-(-(p + n) // PAGE) for p, n in zip(prefixes, lens)]
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    order = torch.randperm(sum(pages), generator=gen).to(torch.int32)
    at = 0
    for r, n in enumerate(pages):
        table[r, :n] = order[at: at + n]
        at += n
    hq, hkv, d = HEADS["hq"], HEADS["hkv"], HEADS["d"]
    k_cache, v_cache = (torch.randn(sum(pages), PAGE, hkv, d, generator=gen) for _ in range(2))
    q = torch.randn(sum(lens), hq, d, generator=gen)
    attn = RaggedVerifyAttention(AttentionShape(sum(lens), len(lens), table.shape[1], hq, hkv, d, PAGE,
                                                num_pages=sum(pages)), "cpu", torch.float32)
    attn.plan(RaggedVerifyLayout.from_verify_lens(lens, width=max(lens)), prefixes, table)
    meta = attn._torch_meta
    one_group = attention_ref.plan_torch_attention(meta, PAGE, torch.float32, max(p + n for p, n in zip(prefixes, lens)))
    return dict(attn=attn, meta=meta, q=q, k=k_cache, v=v_cache, plans={"one group": one_group,
                                                                         "grouped": attn._torch_plan})


def timed(case: dict, repeats: int) -> tuple[dict, float]:
    """Median seconds per call of each plan (alternated) and the largest |difference| of their outputs."""
    outs = {name: torch.full_like(case["q"], float("nan")) for name in case["plans"]}
    samples: dict[str, list[float]] = {name: [] for name in case["plans"]}
    scale = HEADS["d"] ** -0.5
    for _ in range(repeats + 2):
        for name, plan in case["plans"].items():
            start = time.perf_counter()
            attention_ref.ragged_attention_torch(case["q"], case["k"], case["v"], case["meta"], scale, outs[name],
                                                 None, plan)
            samples[name].append(time.perf_counter() - start)
    first, second = outs.values()
    return {name: statistics.median(s[2:]) for name, s in samples.items()}, float((first - second).abs().max())


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)
    print(f"one layer's CPU attention, SmolLM2 heads {HEADS}, float32, 1 thread: B slots x W={args.width} rows "
          f"over P={args.prefix} tokens + a prompt of N rows")
    print(f"{'B':>3} {'N':>4} {'one group us':>13} {'grouped us':>11} {'one / grouped':>14} {'groups':>7} {'max |diff|':>11}")
    rows = []
    for b in args.batch_sizes:
        for prompt in args.prompts:
            case = step(b, prompt, args.width, args.prefix)
            seconds, diff = timed(case, args.repeats)
            ratio = seconds["one group"] / seconds["grouped"]
            groups = len(case["plans"]["grouped"].groups)
            rows.append(dict(batch=b, prompt=prompt, seconds=seconds, one_over_grouped=ratio, groups=groups,
                             max_abs_diff=diff))
            print(f"{b:>3} {prompt:>4} {seconds['one group'] * 1e6:>13.1f} {seconds['grouped'] * 1e6:>11.1f} "
                  f"{ratio:>14.2f} {groups:>7} {diff:>11.2e}")
    result = dict(command="PYTHONPATH=. python perf/fold_attention.py " + " ".join(sys.argv[1:] if argv is None else argv), heads=HEADS,
                  page_size=PAGE, width=args.width, prefix=args.prefix, repeats=args.repeats, threads=1,
                  torch=torch.__version__, platform=platform.platform(), rows=rows)
    print(f"wrote {atomic_write_text(args.out, json.dumps(result, indent=2))}")


if __name__ == "__main__":
    main()
