"""Ascend 910C bring-up ladder (ascend.md section 4) as runnable checks, with a JSON report.

Each step runs its CPU part (pure metadata logic) everywhere and its device part only on an NPU;
without one the device part is skipped with the reason. Step statuses: `pass` (device part passed),
`cpu-pass` (CPU part passed, device part skipped), `skip` (nothing runnable here), `fail`.

    PYTHONPATH=. python perf/ascend_bringup.py                 # CPU: metadata checks, device steps skipped
    PYTHONPATH=. python perf/ascend_bringup.py --device npu    # on a 910C with pip install dspark[npu]

Steps 1 and 2 passing on the NPU records the configuration in a `RaggedGraphCapability`; the report
then says `supports_ragged_verify_graph: true` for it, and only then does compact verify run on NPU.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from dspark.ascend import runtime
from dspark.ascend.capability import (
    NpuVerifyConfig,
    RaggedGraphCapability,
    choose_npu_verify_mode,
)
from dspark.ascend.graphs import NpuGraphBackend, VerifyMetadataBuffers
from dspark.ascend.metadata import AscendVerifyMetadata
from dspark.cli.options import output_path
from dspark.util.fileio import atomic_write_text
from dspark.verify.layout import RaggedVerifyLayout, round_up_to_tier

N = 4                      # static width (draft_token_num) of the checks
TIERS = (8, 16)
SLOTS = (8, 8)
RATIOS = (4, 128)
# (name, verify_lens, live_seq_lens): the edge cases of ladder step 1
CASES = [
    ("worked example", [2, 1, 4], [10, 127, 255]),
    ("v = 1 everywhere", [1, 1, 1, 1], [3, 7, 126, 0]),
    ("v = N everywhere", [N, N, N], [10, 127, 255]),
    ("L = 0", [3, 4, 1], [0, 0, 0]),
    ("group completes at the first verified row", [3, 2], [3, 127]),
    ("group completes at the last verified row", [4, 2], [0, 126]),
]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class StepResult:
    step: int
    name: str
    status: str = "skip"
    reason: str = ""
    cpu_checks: list[Check] = field(default_factory=list)
    device_checks: list[Check] = field(default_factory=list)


def _lists(m: AscendVerifyMetadata, r: int) -> list[tuple[int, int]]:
    g = m.compressed[r]
    return [(p, s) for p, s, ok in zip(g.positions.tolist(), g.slots.tolist(), g.valid.tolist()) if ok]


def eager_case_checks(name: str, lens: list[int], live: list[int]) -> list[Check]:
    """Ragged vs static for one case: real-row positions and KV, compressed entries, padding writes."""
    layout = RaggedVerifyLayout.from_verify_lens(lens, width=N)
    ragged = AscendVerifyMetadata.from_layout(layout, live, RATIOS)
    static = AscendVerifyMetadata.from_static(live, N, RATIOS)
    strided = static.positions.reshape(len(lens), N)
    checks = [
        Check(f"{name}: positions of real rows equal static", torch.equal(layout.pack(strided), ragged.positions)),
        Check(f"{name}: final KV lengths L + v",
              ragged.seq_lens_kv.tolist() == [a + v for a, v in zip(live, lens)]),
    ]
    for r in RATIOS:
        sg = static.compressed[r]
        inside = [(p, s) for p, row, s, ok in zip(sg.positions.tolist(), sg.rows.tolist(), sg.slots.tolist(),
                                                  sg.valid.tolist()) if ok and row % N < lens[s]]
        checks.append(Check(f"{name}: C{r} entries = static entries inside verified rows", _lists(ragged, r) == inside,
                            f"ragged {_lists(ragged, r)} static-inside {inside}"))
    if all(v == N for v in lens):
        diff = ragged.diff(static)
        checks.append(Check(f"{name}: identical to static field for field", not diff, f"differs: {diff}"))
    graph = AscendVerifyMetadata.from_layout(
        RaggedVerifyLayout.from_verify_lens(lens, tiers=TIERS, graph_slots=SLOTS[0], width=N), live, RATIOS)
    locs = torch.arange(1, graph.num_tokens + 1)
    pad = graph.write_locs(locs)[graph.total_rows:]
    checks.append(Check(f"{name}: padding rows write only the dummy slot 0",
                        bool((pad == 0).all()) and graph.seqused[graph.num_requests:].eq(0).all().item()))
    return checks


def step1(device: str) -> StepResult:
    res = StepResult(1, "single rank, eager: compact == static at real rows")
    res.cpu_checks = [c for case in CASES for c in eager_case_checks(*case)]
    if device != "npu":
        res.reason = "device part (compact logits/KV/compressed cache == static through the DSV4 NPU ops) needs an NPU"
        return res
    dev = torch.device("npu")
    for name, lens, live in CASES:
        lay = RaggedVerifyLayout.from_verify_lens(torch.tensor(lens, dtype=torch.int32, device=dev), width=N)
        on_dev = AscendVerifyMetadata.from_layout(lay, torch.tensor(live, device=dev), RATIOS)
        cpu = AscendVerifyMetadata.from_layout(RaggedVerifyLayout.from_verify_lens(lens, width=N), live, RATIOS)
        diff = on_dev.diff(cpu)
        res.device_checks.append(Check(f"{name}: metadata built on the NPU equals the CPU reference", not diff,
                                       f"differs: {diff}"))
    res.reason = "model-level compact == static (DSV4 attention + compressor) is not part of this script"
    return res


def _graph_meta(lens: list[int], live: list[int], device: torch.device) -> AscendVerifyMetadata:
    lay = RaggedVerifyLayout.from_verify_lens(torch.tensor(lens, dtype=torch.int32, device=device),
                                              tiers=TIERS, graph_slots=SLOTS[0], width=N)
    return AscendVerifyMetadata.from_layout(lay, torch.tensor(live, device=device), RATIOS)


def step2(device: str, capability: RaggedGraphCapability, config: NpuVerifyConfig, eager_ok: bool) -> StepResult:
    res = StepResult(2, "single rank, graph: replay == eager, nothing stale across layouts of one tier")
    cpu = torch.device("cpu")
    first, second = _graph_meta([4, 4], [3, 126], cpu), _graph_meta([1, 1], [7, 9], cpu)
    bufs = VerifyMetadataBuffers(first)
    bufs.load(second)
    fresh = VerifyMetadataBuffers(second)
    stale = [k for k, t in fresh.tensors.items() if not torch.equal(bufs.tensors[k], t)]
    res.cpu_checks += [
        Check("[4,4] then [1,1] in tier 8: buffers equal fresh metadata", not stale and bufs.host == fresh.host,
              f"stale: {stale}"),
        Check("tier = round-up of sum(v)", first.tier == round_up_to_tier(8, TIERS) == 8
              and _graph_meta([4, 4, 1], [1, 2, 3], cpu).tier == 16),
    ]
    if device != "npu":
        res.reason = "device part (NPU graph capture/replay with task-group updates) needs an NPU"
        return res
    res.device_checks = _graph_replay_checks(torch.device("npu"))
    graph_ok = all(c.ok for c in res.cpu_checks + res.device_checks) and bool(res.device_checks)
    capability.record(config, eager_passed=eager_ok, graph_passed=graph_ok,
                      detail="; ".join(c.name for c in res.device_checks if not c.ok))
    return res


def _graph_replay_checks(dev: torch.device) -> list[Check]:
    """Capture a step that reads the tier's metadata buffers, replay two layouts, compare with eager."""
    backend = NpuGraphBackend(dev)
    table = torch.arange(1000, dtype=torch.float32, device=dev) * 0.5
    bufs = VerifyMetadataBuffers(_graph_meta([4, 4], [3, 126], dev))
    out = {}

    def step() -> None:
        t = bufs.tensors
        rows = table.index_select(0, t["positions"]) * t["row_valid"]
        c4 = table.index_select(0, t["c4_positions"]) * t["c4_valid"]
        out["rows"], out["c4"] = rows, c4

    graph = backend.capture(step, backend.new_pool())
    checks = []
    for lens, live in (([4, 4], [3, 126]), ([1, 1], [7, 9])):
        meta = _graph_meta(lens, live, dev)
        backend.replay(graph, lambda m=meta: bufs.load(m))
        backend.synchronize()
        want_rows = table.index_select(0, meta.positions) * meta.row_valid
        want_c4 = table.index_select(0, meta.compressed[4].positions) * meta.compressed[4].valid
        checks.append(Check(f"replay == eager for verify_lens {lens}",
                            torch.equal(out["rows"], want_rows) and torch.equal(out["c4"], want_c4)))
    return checks


def step3_cpu() -> StepResult:
    """TP ranks agree by hashing verify_lens (dspark.parallel); equal lens must give equal metadata."""
    from dspark.parallel import verify_lens_hash

    res = StepResult(3, "TP only: identical verify lengths on every rank",
                     reason="device part (hash all-reduce over HCCL on >= 2 NPU ranks) needs NPU ranks")
    lens, live = [2, 1, 4], [10, 127, 255]
    ranks = [AscendVerifyMetadata.from_layout(RaggedVerifyLayout.from_verify_lens(lens, width=N), live, RATIOS)
             for _ in range(2)]
    h = verify_lens_hash(torch.tensor(lens, dtype=torch.int32))
    res.cpu_checks = [
        Check("equal verify_lens hash equal; one row moved changes the hash",
              torch.equal(h, verify_lens_hash(torch.tensor(lens, dtype=torch.int32)))
              and not torch.equal(h, verify_lens_hash(torch.tensor([2, 2, 3], dtype=torch.int32)))),
        Check("equal verify_lens give identical NPU metadata on every TP rank", ranks[0].diff(ranks[1]) == [],
              f"differs: {ranks[0].diff(ranks[1])}"),
    ]
    return res


def step4_5_cpu() -> tuple[StepResult, StepResult]:
    s4 = StepResult(4, "DP attention: global tier, idle participation")
    ranks = {"rank0": ([4, 3], [10, 20]), "rank1": ([1, 2, 1], [5, 6, 7]), "idle rank2": ([], [])}
    global_tier = max(round_up_to_tier(sum(v), TIERS) or TIERS[0] for v, _ in ranks.values())
    metas = {}
    for name, (lens, live) in ranks.items():
        lay = RaggedVerifyLayout.from_verify_lens(torch.tensor(lens, dtype=torch.int32), tiers=[global_tier],
                                                  graph_slots=SLOTS[-1], width=N)
        metas[name] = AscendVerifyMetadata.from_layout(lay, live, RATIOS)
    shapes = {n: (m.num_tokens, m.num_slots, tuple(g.padding_size for g in m.compressed.values()))
              for n, m in metas.items()}
    s4.cpu_checks = [
        Check("every rank's metadata has the DP-global tier's shapes (idle rank included)",
              len(set(shapes.values())) == 1, f"{shapes}"),
        Check("the idle rank's slots are all ghosts (seqused 0, KV length 1)",
              metas["idle rank2"].seqused.eq(0).all().item() and metas["idle rank2"].seq_lens_kv.eq(1).all().item()),
    ]
    s4.reason = "device part (HCCL all-gather of tiers, idle-rank participation) needs >= 2 NPU ranks"
    s5 = StepResult(5, "MoE + DeepEP: dispatch token counts equal the tier")
    s5.cpu_checks = [Check("packed rows per rank == DP-global tier",
                           all(m.num_tokens == m.cu_seqlens_q_host[-1] == global_tier for m in metas.values()))]
    s5.reason = "device part (DeepEP dispatch/combine with ragged token counts) needs a multi-NPU MoE setup"
    return s4, s5


def run(device: str) -> tuple[RaggedGraphCapability, dict]:
    config = NpuVerifyConfig(tiers=TIERS, slots=SLOTS, width=N, compress_ratios=RATIOS,
                             device_name=runtime.device_name() if device == "npu" else "")
    capability = RaggedGraphCapability()
    s1 = step1(device)
    s2 = step2(device, capability, config,
               eager_ok=bool(s1.device_checks) and all(c.ok for c in s1.cpu_checks + s1.device_checks))
    s3 = step3_cpu()
    s4, s5 = step4_5_cpu()
    s6 = StepResult(6, "full DSV4 W8A8: static vs cap-accept vs compact, then throughput",
                    reason="needs the DeepSeek-V4 W8A8 model on a 910C cluster")
    steps = [s1, s2, s3, s4, s5, s6]
    for s in steps:
        checks = s.cpu_checks + s.device_checks
        if any(not c.ok for c in checks):
            s.status = "fail"
        elif s.device_checks:
            s.status = "pass"
        elif s.cpu_checks:
            s.status = "cpu-pass"
    status = capability.status(config)
    mode, why = choose_npu_verify_mode("compact", status)
    return capability, {"device": device, "npu_available": runtime.is_available(), "config": asdict(config),
            "supports_ragged_verify_graph": status.supported, "compact_request_runs": mode.value,
            "mode_reason": why, "steps": [asdict(s) for s in steps]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "npu"], default="cpu")
    ap.add_argument("--out", type=output_path(), default="perf/results/ascend_bringup.json")
    ap.add_argument("--capability", type=output_path(), default=None,
                    help="also write the recorded capability (RaggedGraphCapability.load reads it)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.device == "npu" and not runtime.is_available():
        print(f"--device npu but no NPU is usable; {runtime.INSTALL_HINT}", file=sys.stderr)
        return 2
    capability, report = run(args.device)
    print(f"{'step':<5}{'status':<10}{'cpu checks':<12}{'device checks':<15}name / reason")
    for s in report["steps"]:
        count: Callable[[list], str] = lambda cs: f"{sum(c['ok'] for c in cs)}/{len(cs)}"
        print(f"{s['step']:<5}{s['status']:<10}{count(s['cpu_checks']):<12}{count(s['device_checks']):<15}{s['name']}")
        if s["reason"]:
            print(f"{'':<42}skipped part: {s['reason']}")
        for c in s["cpu_checks"] + s["device_checks"]:
            if not c["ok"]:
                print(f"{'':<42}FAILED {c['name']}: {c['detail']}")
    print(f"compact requested on NPU -> {report['compact_request_runs']} ({report['mode_reason']})")
    atomic_write_text(args.out, json.dumps(report, indent=2))
    if args.capability is not None:
        capability.save(args.capability)
        print(f"wrote {args.capability}")
    print(f"wrote {args.out}")
    return 1 if any(s["status"] == "fail" for s in report["steps"]) else 0


if __name__ == "__main__":
    sys.exit(main())
