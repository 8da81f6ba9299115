"""Helper of `perf/npu_check.sh`, the prepared 910C check: device facts, the multi-rank rungs of the
bring-up ladder (TP agreement, DP-global tier with an idle rank), the graph and kernel benchmarks, and the
merge of every step's output into one JSON.

    PYTHONPATH=. python perf/npu_check.py env     --device npu --out env.json
    PYTHONPATH=. python perf/npu_check.py ranks   --device npu --world 3 --out ranks.json
    PYTHONPATH=. python perf/npu_check.py bench   --device npu --repeats 20 --out bench.json
    PYTHONPATH=. python perf/npu_check.py collect --status steps.tsv --log npu_check.log --out npu_check.json --inputs a.json ...

`--device cpu` is the dry mode: the same code on CPU tensors (Triton through the interpreter, the eager
graph backend, gloo for every group), so CI runs everything but the device calls.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from dspark.util.fileio import atomic_write_text
from dspark.util.options import at_least, output_path
from dspark.verify.attention import AttentionShape

TIERS, SLOTS, WIDTH, RATIOS = (8, 16), 8, 4, (4, 128)


def _device(name: str, rank: int = 0) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    from dspark.ascend import runtime

    runtime.torch_npu()
    return torch.device("npu", rank % torch.npu.device_count())


def _sync(device: torch.device) -> None:
    if device.type == "npu":
        torch.npu.synchronize(device)


def env(device_name: str) -> dict:
    """Versions and the device's facts (the core counts the launch policy uses)."""
    import triton

    out = {"device": device_name, "torch": torch.__version__, "triton": triton.__version__}
    if device_name == "npu":
        from dspark.ascend import runtime

        dev = _device("npu")
        out.update(torch_npu=runtime.torch_npu().__version__, device_name=runtime.device_name(dev),
                   vector_cores=runtime.vector_core_count(dev), ai_cores=runtime.ai_core_count(dev),
                   device_count=torch.npu.device_count())
    return out


def _rank_checks(rank: int, world: int, device_name: str) -> dict:
    """One rank of the TP and DP rungs (run by `run_local_gloo`; the default group is gloo)."""
    import torch.distributed as dist

    from dspark import PlannerSettings, ScheduleConfig, StepsPerSecondTable, VerifyPlanner
    from dspark.ascend import AscendVerifyMetadata
    from dspark.parallel import DpTierAgreement, TpAgreement, TpDisagreementError
    from dspark.verify.layout import RaggedVerifyLayout

    dev = _device(device_name, rank)
    if dev.type == "npu":
        torch.npu.set_device(dev)
    tp_group = dist.new_group(backend="hccl") if dev.type == "npu" else None   # TP collectives on the device
    checks: dict[str, bool] = {}
    # TP: replicated planner inputs give identical verify_lens on every rank; a diverged rank is named by all
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(6, WIDTH - 1, generator=gen) * 2 + 1).to(dev)
    cost = StepsPerSecondTable([1, 8, 16, 24], [100.0, 95.0, 60.0, 40.0], width=WIDTH)
    planner = VerifyPlanner(ScheduleConfig(gamma=WIDTH - 1), cost, PlannerSettings(lag=0), device=dev)
    plan = planner.plan(logits, torch.arange(6), torch.zeros(6, dtype=torch.int64))
    tp = TpAgreement(tp_group)
    checks["tp: replicated inputs agree"] = torch.equal(tp.agree(plan.verify_lens).cpu(), plan.verify_lens.cpu())
    diverged = plan.verify_lens.clone()
    if rank == world - 1:
        diverged[0] = 1 if int(diverged[0]) != 1 else 2
    try:
        tp.agree(diverged)
        checks["tp: a diverged rank raises on every rank"] = False
    except TpDisagreementError as exc:
        checks["tp: a diverged rank raises on every rank"] = exc.ranks == (world - 1,)
    # DP: ranks with different batches and one idle rank agree on the global tier and its shapes
    lens = {0: [4, 3], 1: [1, 2, 1]}.get(rank, [])
    dp = DpTierAgreement(dist.group.WORLD, tiers=TIERS, graph_slots=SLOTS, width=WIDTH)
    decision = dp.agree(torch.tensor(lens, dtype=torch.int32))
    layout = RaggedVerifyLayout.from_verify_lens(torch.tensor(lens, dtype=torch.int32, device=dev),
                                                 tiers=[decision.tier], graph_slots=SLOTS, width=WIDTH)
    meta = AscendVerifyMetadata.from_layout(layout, torch.arange(len(lens), device=dev) * 7 + 5, RATIOS)
    shape = torch.tensor([meta.num_tokens, meta.num_slots, *(g.padding_size for g in meta.compressed.values())])
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    checks["dp: the global tier is the round-up of the largest rank"] = decision.tier == 8
    checks["dp: every rank's metadata has the global tier's shapes"] = all(torch.equal(s, shapes[0]) for s in shapes)
    if not lens:
        checks["dp: the idle rank is all ghosts"] = bool(meta.seqused.eq(0).all()) and decision.idle_ranks == (2,)
    return {"rank": rank, "device": str(dev), "checks": checks}


def ranks(device_name: str, world: int) -> dict:
    """The TP and DP rungs on `world` ranks (one process each; NPU rank r on npu:r)."""
    from dspark.parallel.launch import run_local_gloo

    results = run_local_gloo(_rank_checks, world, args=(device_name,), timeout=300.0)
    ok = all(all(r["checks"].values()) for r in results)
    return {"world": world, "passed": ok, "ranks": results}


def _median_us(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _kernel_cases(dev: torch.device) -> dict[str, Callable[[], object]]:
    """One launch per kernel module: serving sizes on the NPU (B = 64, W = 8, vocab 32000, 16 x 8 heads of
    128), small ones in the dry mode (the interpreter)."""
    from dspark.kernels import accept, layout, topk
    from dspark.verify.attention import RaggedVerifyAttention
    from dspark.verify.layout import RaggedVerifyLayout

    b, w, vocab, hq, hkv, d = (64, 8, 32000, 16, 8, 128) if dev.type == "npu" else (4, 4, 64, 4, 2, 16)
    dtype, pages = (torch.bfloat16 if dev.type == "npu" else torch.float32), 4 * b
    gen = torch.Generator().manual_seed(0)
    s = torch.cummin(torch.rand(b, w - 1, generator=gen), 1).values.to(dev)
    lens = torch.randint(1, w + 1, (b,), generator=gen, dtype=torch.int32).to(dev)
    logits = torch.randn(b, w, vocab, generator=gen).to(dev)
    draft = logits[:, : w - 1].argmax(-1)
    row_slot, row_within = layout.row_maps_ref(lens, int(lens.sum()))
    lay = RaggedVerifyLayout.from_verify_lens(lens, tiers=[b * w], graph_slots=b + 8, width=w)
    attn = RaggedVerifyAttention(AttentionShape(b * w, b + 8, 4, hq, hkv, d, 16, num_pages=pages), dev, dtype)
    kc, vc = (torch.randn(pages, 16, hkv, d, generator=gen).to(dev, dtype) for _ in range(2))
    attn.plan(lay, torch.full((b,), 40, dtype=torch.int32, device=dev),
              torch.randperm(pages, generator=gen).reshape(b, 4).to(dev, torch.int32))
    q = torch.randn(b * w, hq, d, generator=gen).to(dev, dtype)
    i32 = lambda n: torch.empty(n, dtype=torch.int32, device=dev)  # noqa: E731
    return {
        "topk.verify_lens": lambda: topk.verify_lens_triton(s, 3 * b, 1, w, 1e-6, out=i32(b)),
        "layout.qo_indptr": lambda: layout.qo_indptr_triton(lens, i32(b + 1)),
        "layout.pack": lambda: layout.pack_triton(logits, row_slot, row_within, row_slot.numel(), 0.0,
                                                  torch.empty(row_slot.numel(), vocab, device=dev)),
        "accept.greedy": lambda: accept.greedy_triton(draft, logits, lens, None, i32(b),
                                                      torch.empty(b, dtype=torch.int64, device=dev)),
        "attention.run": lambda: attn.run(q, kc, vc),
    }


def bench(device_name: str, repeats: int) -> dict:
    """Kernel launches (median us) under the device's launch policy, and graph replay vs eager of a step
    that reads one tier's metadata buffers."""
    from dspark.ascend import AscendVerifyMetadata, NpuGraphBackend, VerifyMetadataBuffers
    from dspark.kernels import dispatch
    from dspark.verify.graphs import EagerBackend
    from dspark.verify.layout import RaggedVerifyLayout

    dev = _device(device_name)
    prev = os.environ.get(dispatch.BACKEND_ENV)
    os.environ[dispatch.BACKEND_ENV] = "triton"   # the kernels also on CPU tensors (dry mode: interpreted)
    try:
        kernels = {name: _median_us(fn, repeats, dev) for name, fn in _kernel_cases(dev).items()}
    finally:
        os.environ.pop(dispatch.BACKEND_ENV) if prev is None else os.environ.update({dispatch.BACKEND_ENV: prev})

    def meta(lens: list[int]) -> AscendVerifyMetadata:
        lay = RaggedVerifyLayout.from_verify_lens(torch.tensor(lens, dtype=torch.int32, device=dev), tiers=TIERS,
                                                  graph_slots=SLOTS, width=WIDTH)
        return AscendVerifyMetadata.from_layout(lay, torch.arange(len(lens), device=dev) * 9 + 3, RATIOS)

    table = torch.arange(4096, dtype=torch.float32, device=dev)
    bufs = VerifyMetadataBuffers(meta([4, 4]))
    out: dict[str, torch.Tensor] = {}

    def step() -> None:
        t = bufs.tensors
        out["rows"] = table.index_select(0, t["positions"]) * t["row_valid"]

    backend = NpuGraphBackend(dev) if dev.type == "npu" else EagerBackend()
    graph = backend.capture(step, backend.new_pool())
    second = meta([1, 2])
    replay_us = _median_us(lambda: backend.replay(graph, lambda: bufs.load(second)), repeats, dev)
    same = torch.equal(out["rows"], table.index_select(0, second.positions) * second.row_valid)
    eager_us = _median_us(lambda: (bufs.load(second), step()), repeats, dev)
    return {"kernels_us": kernels, "graph": {"backend": type(backend).__name__, "replay_us": replay_us,
                                             "eager_us": eager_us, "replay_equals_eager": same},
            "passed": same}


def collect(status: Path, paths: list[Path], log: Path) -> dict:
    """One JSON: each step's exit code and seconds (`status`: lines `name rc seconds`), every step's JSON
    output by file stem, and the suite's device-count line from the log; unreadable outputs are named."""
    steps = {}
    for line in status.read_text().splitlines():
        name, rc, seconds = line.split()
        steps[name] = {"exit": int(rc), "seconds": int(seconds)}
    outputs, missing = {}, []
    for p in paths:
        try:
            outputs[p.stem] = json.loads(p.read_text())
        except (OSError, ValueError):
            missing.append(p.name)
    text = log.read_text(errors="replace") if log.is_file() else ""
    suite = [ln for ln in text.splitlines() if ln.startswith("dspark: ") and " tests ran on --device " in ln]
    return {"steps": steps, "outputs": outputs, "missing": missing, "suite": suite[-1] if suite else None,
            "passed": bool(steps) and all(s["exit"] == 0 for s in steps.values()) and not missing}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["env", "ranks", "bench", "collect"])
    ap.add_argument("--inputs", nargs="*", type=Path, default=[], help="collect: the step outputs to merge")
    ap.add_argument("--status", type=Path, help="collect: the steps' `name rc seconds` lines")
    ap.add_argument("--log", type=Path, help="collect: the run's log (for the suite's device-count line)")
    ap.add_argument("--device", choices=["cpu", "npu"], default="cpu", help="cpu = the dry mode")
    ap.add_argument("--world", type=at_least(1), default=3)
    ap.add_argument("--repeats", type=at_least(1), default=20)
    ap.add_argument("--out", type=output_path(), required=True)
    args = ap.parse_args(argv)
    if args.what == "collect":
        report = collect(args.status, args.inputs, args.log)
    else:
        report = {"env": lambda: env(args.device), "ranks": lambda: ranks(args.device, args.world),
                  "bench": lambda: bench(args.device, args.repeats)}[args.what]()
    atomic_write_text(args.out, json.dumps(report, indent=2, default=str))
    print(json.dumps(report, indent=1, default=str)[:4000])
    return 0 if report.get("passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
