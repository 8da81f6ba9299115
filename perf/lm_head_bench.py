"""The target's LM head on the CPU: `F.linear` (h @ W^T) against one W @ h^T product, and what
`TransformersCausalLM.logits` picks, per row count (docs/architecture.md, "The LM head on a CPU").

A one-layer Llama with SmolLM2-135M's head (vocab 49152 x hidden 576, fp32, seeded random weights) is built
from its config. Every row count's three calls are timed in turn, `--repeats` rounds after warm-up calls;
the table shows medians in ms, and the JSON keeps every call's time.

    PYTHONPATH=. python perf/lm_head_bench.py [--rows 1,2,3,4,6,8,10,12,16,24,32] [--threads 1]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Callable

import torch
from transformers import LlamaConfig

from dspark.models.transformers_lm import CPU_MM_MAX_ROWS, TransformersCausalLM
from dspark.util.fileio import write_json_atomic
from dspark.util.options import at_least, int_list, output_path

HIDDEN, VOCAB = 576, 49152  # SmolLM2-135M


def head_model() -> TransformersCausalLM:
    """A seeded one-layer Llama with SmolLM2-135M's hidden size and vocabulary (untied LM head)."""
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=1, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=VOCAB, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return TransformersCausalLM.from_config(config).eval()


def timed(fn: Callable[[], torch.Tensor]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int_list(1), default=(1, 2, 3, 4, 6, 8, 10, 12, 16, 24, 32))
    ap.add_argument("--repeats", type=at_least(1), default=15, help="timed rounds per row count")
    ap.add_argument("--warmup", type=at_least(0), default=3)
    ap.add_argument("--threads", type=at_least(1), default=1)
    ap.add_argument("--out", type=output_path(), default="perf/results/lm_head_bench.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = head_model()
    weight = lm.hf_model.get_output_embeddings().weight.detach()
    gen = torch.Generator().manual_seed(1)
    paths = {"linear": lambda h: torch.nn.functional.linear(h, weight),
             "mm": lambda h: torch.mm(weight, h.t()).t().contiguous(),
             "logits": lm.logits}
    rows = []
    print(f"LM head {VOCAB} x {HIDDEN} fp32, {args.threads} thread(s); medians of {args.repeats} calls, ms "
          f"(logits uses mm up to {CPU_MM_MAX_ROWS} rows)")
    print(f"{'rows':>5} {'linear':>8} {'mm':>8} {'logits':>8} {'mm/linear':>10}")
    with torch.no_grad():
        for n in args.rows:
            h = torch.randn(n, HIDDEN, generator=gen)
            for _ in range(args.warmup):
                for fn in paths.values():
                    fn(h)
            secs: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.repeats):  # the three paths interleaved, so drift hits them alike
                for name, fn in paths.items():
                    secs[name].append(timed(lambda: fn(h)))
            med = {name: statistics.median(v) * 1e3 for name, v in secs.items()}
            rows.append({"rows": n, "median_ms": med, "seconds": secs})
            print(f"{n:>5} {med['linear']:>8.2f} {med['mm']:>8.2f} {med['logits']:>8.2f} "
                  f"{med['mm'] / med['linear']:>10.2f}")
    out = {"command": "PYTHONPATH=. python perf/lm_head_bench.py " + " ".join(argv or []),
           "platform": platform.platform(), "torch": torch.__version__, "threads": args.threads,
           "cpu_mm_max_rows": CPU_MM_MAX_ROWS, "rows": rows}
    write_json_atomic(args.out, out)
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
