"""Does compact verification pay for itself? Target verify-forward time in static / cap-accept / compact mode.

Per batch size B (gamma 6, W = 7): B held-out prompts are prefilled into a paged KV cache (the engine's
`PagedKVCache` and attention metadata), then for each set of verify lengths (seeded random in [1, W] with a
given mean rows per request, exact sum round(mean * B), plus the full static B*W) the target's verify
forward is timed in the three modes, each through `dspark.build_verify_inputs` and the model's own forward
over the paged cache (inputs + attention plan + 30 transformer layers + LM head: what the engine charges to
its verify phase). Thread CPU time, one intra-op thread, median over `--repeats`; each repeat runs every
(set, mode) pair once in a fresh seeded order, so machine noise hits all modes alike. static and cap-accept
run B*W rows, compact sum(verify_lens) rows (padded to `--tiers` when given).

Reported per B and set: rows ratio sum(verify_lens) / (B*W), time ratio compact / static, and the issue's
criterion `time ratio <= 1.15 x rows ratio` (judged at B = 16, or the largest B run). Before timing, the
compact logits at every real row are checked against static's (and cap-accept's against static's), so the
timings compare equal work. Writes perf/results/verify_modes.json and a PNG (time vs rows per mode).

    PYTHONPATH=. python perf/verify_modes.py [--model real|tiny] [--batch-sizes 1,4,16] [--repeats 7]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from dspark.config import VerifyMode
from dspark.models.corpus import prompt_windows
from dspark.models.paged_attend import PagedAttend
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve.attention import batch_attention
from dspark.serve.kv_cache import PagedKVCache
from dspark.util.fileio import atomic_write, write_json_atomic
from dspark.util.options import at_least, output_path
from dspark.verify.attention import RaggedVerifyAttention
from dspark.verify.inputs import VerifyExecution, build_verify_inputs
from dspark.verify.layout import RaggedVerifyLayout, check_tiers

MODES = (VerifyMode.STATIC, VerifyMode.CAP_ACCEPT, VerifyMode.COMPACT)
SLACK = 1.15          # the issue's allowance: compact / static <= 1.15 x rows ratio
CRITERION_BATCH = 16  # ... at B = 16
LOGIT_ATOL = 2e-3     # float32 logits of the same rows in forwards of different row counts
PAGE_SIZE = 16


def load_target(model: str) -> tuple[TransformersCausalLM, object | None]:
    """(target, text -> ids encoder or None): SmolLM2-135M (`real`) or the tests' tiny random Llama (`tiny`)."""
    if model == "real":
        from transformers.utils import logging

        from dspark.models import load_smollm2

        logging.disable_progress_bar()
        target, tokenizer = load_smollm2()
        return target, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    if model == "tiny":
        root = str(Path(__file__).resolve().parents[1])  # for tests.engine_models when run as a script
        if root not in sys.path:
            sys.path.insert(0, root)
        from tests.engine_models import tiny_llama

        return TransformersCausalLM(tiny_llama(vocab=256, max_seq_len=256)), None
    raise ValueError(f"--model must be real or tiny, got {model!r}")


def draw_verify_lens(b: int, w: int, mean: float, gen: torch.Generator) -> Tensor:
    """[b] int32 verify lengths in [1, w] summing to round(mean * b) (clamped to [b, b*w]): the extra rows
    beyond each request's root are spread over the b * (w - 1) draft positions uniformly at random."""
    if not 1.0 <= mean <= w:
        raise ValueError(f"mean verify length must be in [1, W={w}], got {mean}")
    extra = min(max(round(mean * b), b), b * w) - b
    chosen = torch.randperm(b * (w - 1), generator=gen)[:extra]
    return (1 + torch.bincount(chosen // (w - 1), minlength=b)).to(torch.int32)


class VerifyBench:
    """B prompts prefilled into a paged cache; `forward(mode, verify_lens)` runs one verify forward over it."""

    def __init__(self, target: TransformersCausalLM, prompts: Tensor, gamma: int, tiers: Sequence[int], seed: int):
        b, p = prompts.shape
        self.target, self.b, self.w, self.tiers = target, b, gamma + 1, list(tiers)
        g = target.geometry
        max_len = p + self.w
        self.cache = PagedKVCache(num_layers=g.num_layers, num_heads=g.num_kv_heads, head_dim=g.head_dim,
                                  num_pages=b * -(-max_len // PAGE_SIZE), page_size=PAGE_SIZE)
        self.cache.admit(b, max_len)
        self.slots = b + -(-self.tiers[-1] // self.w) if self.tiers else None  # ghost slots for tier padding
        rows = max(b * (p - 1), b * self.w, self.tiers[-1] if self.tiers else 0)
        self.attn: RaggedVerifyAttention = batch_attention(self.cache, g, rows, self.slots or b + 1)
        # prefill positions 0..P-2; the root (last prompt token) sits at P-1, its KV written by the verify
        zeros = torch.zeros(b, dtype=torch.int64)
        self._run(prompts[:, :-1].reshape(-1), RaggedVerifyLayout.from_verify_lens(torch.full((b,), p - 1)), zeros)
        self.prefix = torch.full((b,), p - 1, dtype=torch.int64)
        self.root = prompts[:, -1].clone()
        gen = torch.Generator().manual_seed(seed)
        self.drafts = torch.randint(0, g.vocab_size, (b, gamma), generator=gen)

    def _run(self, tokens: Tensor, layout: RaggedVerifyLayout, prefix: Tensor) -> Tensor:
        attend = PagedAttend(self.attn, self.cache.k, self.cache.v, layout, prefix, self.cache.block_table)
        return self.target.logits(self.target(tokens, attend.positions, attend))

    def forward(self, mode: VerifyMode, verify_lens: Tensor) -> tuple[Tensor, RaggedVerifyLayout]:
        """(logits [rows, V], layout) of one verify forward in `mode`, as the engine's verify phase runs it."""
        vin = build_verify_inputs(VerifyExecution(mode, self.tiers or None, self.slots), verify_lens, self.root,
                                  self.drafts, self.prefix)
        return self._run(vin.input_ids, vin.layout, self.prefix), vin.layout


def real_row_diff(static: Tensor, other: Tensor, layout: RaggedVerifyLayout, w: int) -> float:
    """Max |logit difference| over the real rows of `other` (packed by `layout`) vs static's first B*W rows
    (past them: tier padding)."""
    dense = layout.scatter(other, width=w, fill=float("nan")).flatten(0, 1)
    real = ~dense[:, 0].isnan()
    return float((dense[real] - static[: dense.shape[0]][real]).abs().max())


def time_batch(bench: VerifyBench, sets: list[dict], repeats: int, seed: int) -> None:
    """Check equal work, then fill each set's `ms` (per-mode sample lists) with interleaved timings."""
    w = bench.w
    for s in sets:  # equal work: compact / cap-accept real rows equal static's (also the warm-up pass)
        vl = torch.tensor(s["verify_lens"], dtype=torch.int32)
        static, _ = bench.forward(VerifyMode.STATIC, vl)
        cap, cap_layout = bench.forward(VerifyMode.CAP_ACCEPT, vl)
        compact, layout = bench.forward(VerifyMode.COMPACT, vl)
        s["max_abs_diff"] = {"cap-accept": real_row_diff(static, cap, cap_layout, w),
                             "compact": real_row_diff(static, compact, layout, w)}
        s["forward_rows"] = {"static": cap_layout.graph_num_tokens, "cap-accept": cap_layout.graph_num_tokens,
                             "compact": layout.graph_num_tokens}
        worst = max(s["max_abs_diff"].values())
        if not worst <= LOGIT_ATOL:
            raise AssertionError(f"B={bench.b} verify_lens {s['verify_lens']}: real-row logits differ from "
                                 f"static's by {worst:.3g} > {LOGIT_ATOL}")
        s["ms"] = {m.value: [] for m in MODES}
    jobs = [(i, m) for i in range(len(sets)) for m in MODES]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(repeats):
        for j in torch.randperm(len(jobs), generator=gen).tolist():
            i, mode = jobs[j]
            vl = torch.tensor(sets[i]["verify_lens"], dtype=torch.int32)
            t0 = time.thread_time()
            bench.forward(mode, vl)
            sets[i]["ms"][mode.value].append((time.thread_time() - t0) * 1e3)


def summarize(sets: list[dict], b: int, w: int) -> None:
    """Medians, ratios and the criterion per set (in place)."""
    for s in sets:
        med = {m: statistics.median(v) for m, v in s["ms"].items()}
        s["median_ms"] = med
        s["rows_ratio"] = s["rows"] / (b * w)
        s["time_ratio"] = med["compact"] / med["static"]
        s["time_ratio_cap_accept"] = med["cap-accept"] / med["static"]
        s["paired_time_ratio"] = statistics.median(c / st for c, st in zip(s["ms"]["compact"], s["ms"]["static"]))
        s["bound"] = SLACK * s["rows_ratio"]
        s["meets"] = s["time_ratio"] <= s["bound"]


def plot(path: Path, results: dict, title: str) -> None:
    """Median verify ms vs sum(verify_lens) per mode, one panel per B, with the criterion's bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(results)
    fig, axes = plt.subplots(1, len(batches), figsize=(4.6 * len(batches), 3.6), squeeze=False)
    for ax, b in zip(axes.flat, batches):
        sets = sorted(results[b]["sets"], key=lambda s: s["rows"])
        rows = [s["rows"] for s in sets]
        for mode, marker in (("static", "s"), ("cap-accept", "^"), ("compact", "o")):
            ax.plot(rows, [s["median_ms"][mode] for s in sets], marker=marker, lw=1.2, label=mode)
        ax.plot(rows, [s["bound"] * s["median_ms"]["static"] for s in sets], "k:", lw=1,
                label=f"{SLACK} x rows ratio x static")
        ax.set_title(f"B = {b}")
        ax.set_xlabel("sum(verify_lens) (static / cap-accept run B*W rows)")
        ax.set_ylabel("verify forward ms (median)")
        ax.set_ylim(bottom=0)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


def parse_ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{name} must be comma-separated ints, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"{name} must be positive ints, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="real", choices=("real", "tiny"))
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--gamma", type=at_least(1), default=6)
    ap.add_argument("--mean-lens", default="2,3,4,5", help="mean verify rows per request of the random sets")
    ap.add_argument("--prompt-len", type=at_least(3), default=64, help="tokens per prompt (the cached context)")
    ap.add_argument("--repeats", type=at_least(1), default=7)
    ap.add_argument("--tiers", default="", help="captured tiers compact pads to (default: none, eager)")
    ap.add_argument("--seed", type=at_least(0), default=0)
    ap.add_argument("--out", type=output_path(), default="perf/results/verify_modes.json")
    ap.add_argument("--png", type=output_path(), default=None, help="default: --out with .png")
    args = ap.parse_args(argv)
    try:
        args.means = [float(x) for x in args.mean_lens.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--mean-lens must be comma-separated numbers, got {args.mean_lens!r}") from None
    if not args.means or any(not 1 <= m <= args.gamma + 1 for m in args.means):
        raise SystemExit(f"--mean-lens must be numbers in [1, gamma + 1 = {args.gamma + 1}], got {args.mean_lens!r}")
    args.batches = parse_ints(args.batch_sizes, "--batch-sizes")
    args.tier_list = check_tiers(parse_ints(args.tiers, "--tiers")) if args.tiers else []
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the comparison; prints the table, writes JSON + PNG, returns the JSON summary."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    target, encode = load_target(args.model)
    w = args.gamma + 1
    if args.prompt_len + w > target.geometry.max_seq_len:
        raise SystemExit(f"--prompt-len {args.prompt_len} + W {w} exceeds the model's max_seq_len "
                         f"{target.geometry.max_seq_len}")
    gen = torch.Generator().manual_seed(args.seed)
    results: dict[int, dict] = {}
    for b in args.batches:
        if encode is not None:
            prompts = prompt_windows("heldout", encode, b, args.prompt_len, args.seed)
        else:
            prompts = torch.randint(3, target.geometry.vocab_size, (b, args.prompt_len), generator=gen)
        bench = VerifyBench(target, prompts, args.gamma, args.tier_list, args.seed + b)
        sets = []
        for mean in args.means + [float(w)]:
            vl = draw_verify_lens(b, w, mean, gen)
            sets.append({"mean_len": mean, "full": mean == w, "verify_lens": vl.tolist(), "rows": int(vl.sum())})
        time_batch(bench, sets, args.repeats, args.seed + b)
        summarize(sets, b, w)
        results[b] = {"sets": sets}
    judged = CRITERION_BATCH if CRITERION_BATCH in results else max(results)
    verdict = [s["meets"] for s in results[judged]["sets"] if not s["full"]]
    summary = {
        "command": " ".join(["PYTHONPATH=. python perf/verify_modes.py", *(sys.argv[1:] if argv is None else argv)]),
        "model": args.model, "target": type(target.hf_model).__name__,
        "geometry": {"layers": target.geometry.num_layers, "hidden": target.geometry.hidden_size,
                     "vocab": target.geometry.vocab_size},
        "platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "clock": "thread", "gamma": args.gamma, "width": w, "prompt_len": args.prompt_len,
        "repeats": args.repeats, "tiers": args.tier_list, "slack": SLACK, "logit_atol": LOGIT_ATOL,
        "results": {str(b): r for b, r in results.items()},
        "criterion": {"batch": judged, "rule": f"compact/static time <= {SLACK} x sum(verify_lens)/(B*W)",
                      "meets_all": all(verdict), "meets": sum(verdict), "sets": len(verdict)},
        "seconds": time.perf_counter() - t_start,
    }
    print(format_table(summary))
    write_json_atomic(args.out, summary)
    png = Path(args.png or str(Path(args.out).with_suffix(".png")))
    plot(png, results, f"{summary['target']} verify forward, W = {w}, prompt {args.prompt_len}, "
                       f"{args.repeats} repeats, 1 thread (thread CPU time)")
    print(f"wrote {args.out} and {png} in {summary['seconds']:.0f} s")
    return summary


def format_table(summary: dict) -> str:
    """The per-(B, set) table and the criterion line."""
    lines = [f"{summary['target']} ({summary['model']}), W = {summary['width']}, prompt {summary['prompt_len']}, "
             f"median of {summary['repeats']} (thread CPU time, 1 thread)",
             "|   B | mean len | rows | rows ratio | static ms | cap-accept ms | compact ms | time ratio | "
             f"<= {SLACK} x rows | max |dlogit| |",
             "|----:|---------:|-----:|-----------:|----------:|--------------:|-----------:|-----------:|"
             "-----------:|------------:|"]
    for b, r in summary["results"].items():
        for s in r["sets"]:
            med = s["median_ms"]
            lines.append(f"| {b:>3} | {s['mean_len']:8.1f} | {s['rows']:4d} | {s['rows_ratio']:10.3f} | "
                         f"{med['static']:9.2f} | {med['cap-accept']:13.2f} | {med['compact']:10.2f} | "
                         f"{s['time_ratio']:10.3f} | {s['bound']:5.3f} {'yes' if s['meets'] else 'NO ':>4} | "
                         f"{max(s['max_abs_diff'].values()):11.2e} |")
    c = summary["criterion"]
    lines.append(f"criterion at B = {c['batch']} ({c['rule']}): {c['meets']} of {c['sets']} verify-length sets "
                 f"meet it -> {'MET' if c['meets_all'] else 'NOT MET'}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
