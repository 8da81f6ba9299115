"""Accept on packed rows vs expanding them to strided [B, W, V] first: peak extra memory and time.

One run compares, for greedy and sampling accept, at B = 64, gamma = 7, V = 32000 (random verify
lengths in [1, W], seed fixed):
  packed   accept_greedy / accept_sampling(..., layout=layout) on the packed [rows, V] target rows
  expand   layout.scatter(rows, width=W) to [B, W, V], then the strided accept
Peak extra memory: the most bytes the torch allocator holds during one run above what it held before
(the inputs): torch.cuda.max_memory_allocated on CUDA, the profiler's allocation events on the CPU.
Time: median over repeats. Prints a table and writes JSON to perf/results/.

    PYTHONPATH=. python perf/accept_bench.py [--device cuda] [--repeats 20] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dspark import RaggedVerifyLayout, accept_greedy, accept_sampling
from dspark.util.fileio import atomic_write_text
from dspark.util.options import at_least, output_path

METHODS = ("greedy/packed", "greedy/expand", "sampling/packed", "sampling/expand")


def make_inputs(b: int, gamma: int, vocab: int, device: torch.device, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    w = gamma + 1
    vl = torch.randint(1, w + 1, (b,), generator=gen, dtype=torch.int32)
    layout = RaggedVerifyLayout.from_verify_lens(vl.to(device), width=w)
    rows = layout.total_rows
    logits = torch.randn(rows, vocab, generator=gen).to(device)
    probs = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(b, gamma, vocab, generator=gen), -1).to(device)
    draft = torch.multinomial(q.view(-1, vocab).cpu(), 1, generator=gen).view(b, gamma).to(device)
    return dict(layout=layout, vl=vl.to(device), logits=logits, probs=probs, q=q, draft=draft, width=w)


def run(method: str, x: dict) -> torch.Tensor:
    kind, how = method.split("/")
    lay, w = x["layout"], x["width"]
    target = x["logits"] if kind == "greedy" else x["probs"]
    if how == "expand":
        target, lay = lay.scatter(target, width=w), None
    if kind == "greedy":
        return accept_greedy(x["draft"], target, x["vl"], layout=lay).commit_lens
    gen = torch.Generator(device=x["draft"].device).manual_seed(1)
    return accept_sampling(x["draft"], x["q"], target, x["vl"], generator=gen, layout=lay).commit_lens


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_method(method: str, x: dict, device: torch.device, repeats: int) -> float:
    run(method, x)  # warm-up (kernel compile, allocator)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        run(method, x)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_extra_bytes(method: str, x: dict, device: torch.device) -> int:
    """Peak bytes allocated by one run above what was allocated before it (inputs excluded)."""
    run(method, x)
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run(method, x)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    # CPU: replay the allocator's [memory] events (+alloc / -free, in time order) of a profiled run
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run(method, x)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=at_least(1), default=64)
    ap.add_argument("--gamma", type=at_least(1), default=7)
    ap.add_argument("--vocab", type=at_least(1), default=32000)
    ap.add_argument("--repeats", type=at_least(1), default=20)
    ap.add_argument("--threads", type=at_least(1), default=1, help="torch CPU threads (1: stable on a shared machine)")
    ap.add_argument("--out", type=output_path(), default="perf/results/accept_bench.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    x = make_inputs(args.batch, args.gamma, args.vocab, device)
    strided_mib = args.batch * x["width"] * args.vocab * 4 / 2**20
    rows = []
    for method in METHODS:
        rows.append(dict(method=method, median_ms=1e3 * time_method(method, x, device, args.repeats),
                         peak_extra_mib=peak_extra_bytes(method, x, device) / 2**20))
    for kind in ("greedy", "sampling"):
        packed, expand = (r for r in rows if r["method"].startswith(kind))
        packed["time_ratio_vs_expand"] = packed["median_ms"] / expand["median_ms"]
    print(f"B={args.batch} gamma={args.gamma} V={args.vocab} rows={x['layout'].total_rows} "
          f"(strided [B, W, V] fp32 = {strided_mib:.1f} MiB) device={device}")
    print(f"{'method':<18}{'median ms':>12}{'peak extra MiB':>16}")
    for r in rows:
        print(f"{r['method']:<18}{r['median_ms']:>12.2f}{r['peak_extra_mib']:>16.1f}")
    result = dict(batch=args.batch, gamma=args.gamma, vocab=args.vocab, rows=x["layout"].total_rows,
                  device=str(device), torch=torch.__version__, repeats=args.repeats, threads=args.threads,
                  strided_fp32_mib=strided_mib, results=rows)
    print(f"wrote {atomic_write_text(args.out, json.dumps(result, indent=2))}")


if __name__ == "__main__":
    main()
