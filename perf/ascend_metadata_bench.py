"""Cost of building the NPU TARGET_VERIFY metadata per step: ragged (`from_layout` on a prebuilt layout,
eager and padded to a tier) vs today's fixed width (`from_static`), over batch sizes; the layout build
itself is timed alongside for context. Median of repeats, one table, JSON.

    PYTHONPATH=. python perf/ascend_metadata_bench.py [--device cpu|npu] [--repeats 50] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from dspark.ascend import AscendVerifyMetadata, runtime
from dspark.util.fileio import atomic_write_text
from dspark.util.options import at_least, output_path
from dspark.verify.layout import RaggedVerifyLayout

WIDTH = 8  # W = gamma + 1 with gamma = 7


def _median_us(fn, repeats: int, sync) -> float:
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def run(device: torch.device, batches: list[int], repeats: int) -> list[dict]:
    sync = runtime.torch_npu().npu.synchronize if device.type == "npu" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        lens = torch.randint(1, WIDTH + 1, (b,), generator=gen, dtype=torch.int32).to(device)
        live = torch.randint(0, 8192, (b,), generator=gen).to(device)
        tiers = [((int(lens.sum()) + 63) // 64) * 64]
        build = lambda: RaggedVerifyLayout.from_verify_lens(lens, width=WIDTH)
        eager_layout = build()
        graph_layout = RaggedVerifyLayout.from_verify_lens(lens, tiers=tiers, graph_slots=b + 64 // WIDTH, width=WIDTH)
        r = {"batch": b, "rows": int(lens.sum()), "tier": tiers[0],
             "static_us": _median_us(lambda: AscendVerifyMetadata.from_static(live, WIDTH), repeats, sync),
             "ragged_eager_us": _median_us(lambda: AscendVerifyMetadata.from_layout(eager_layout, live), repeats, sync),
             "ragged_graph_us": _median_us(lambda: AscendVerifyMetadata.from_layout(graph_layout, live), repeats, sync),
             "layout_build_us": _median_us(build, repeats, sync)}
        r["ragged_eager_over_static"] = r["ragged_eager_us"] / r["static_us"]
        rows.append(r)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "npu"], default="cpu")
    ap.add_argument("--repeats", type=at_least(1), default=50)
    ap.add_argument("--batches", type=at_least(1), nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--threads", type=at_least(1), default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--out", type=output_path(), default="perf/results/ascend_metadata_bench.json")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device("npu" if args.device == "npu" else "cpu")
    rows = run(device, args.batches, args.repeats)
    print(f"{'B':>5} {'rows':>6} {'tier':>6} {'static us':>10} {'ragged us':>10} {'graph us':>10} "
          f"{'ragged/static':>14} {'layout us':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['rows']:>6} {r['tier']:>6} {r['static_us']:>10.1f} {r['ragged_eager_us']:>10.1f} "
              f"{r['ragged_graph_us']:>10.1f} {r['ragged_eager_over_static']:>14.2f} {r['layout_build_us']:>10.1f}")
    atomic_write_text(args.out, json.dumps({"device": args.device, "width": WIDTH, "repeats": args.repeats,
                                            "threads": torch.get_num_threads(), "torch": torch.__version__,
                                            "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
