"""Ascend 910C bring-up ladder (ascend.md section 4) as runnable checks, with a JSON report.

Each step runs its CPU part everywhere and its device part only on an NPU; without one the device part is
skipped with the reason. The CPU part of rungs 1-4 runs a tiny Llama through the NPU attention backend with
the fused infer attention operator emulated (`dspark.ascend.emulator`): 1 eager decoding in every verify
mode == dspark's default attention; 2 a tier captured through `NpuGraphBackend` (an emulated recording
graph) replays successive layouts == eager; 3 two gloo TP ranks agree on verify_lens and compute identical
rows; 4 two gloo DP ranks, one idle, agree on the DP-global tier and the idle rank writes no KV. Step
statuses: `pass` (device part passed), `cpu-pass` (CPU part passed, device part skipped), `skip`
(nothing runnable here), `fail`.

    PYTHONPATH=. python perf/ascend_bringup.py                 # CPU: metadata checks, device steps skipped
    PYTHONPATH=. python perf/ascend_bringup.py --device npu    # on a 910C with pip install dspark[npu]

Steps 1 and 2 passing on the NPU records the configuration in a `RaggedGraphCapability`; the report
then says `supports_ragged_verify_graph: true` for it, and only then does compact verify run on NPU.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from dspark.ascend import runtime
from dspark.ascend.attention import npu_attention
from dspark.ascend.capability import (
    NpuVerifyConfig,
    RaggedGraphCapability,
    choose_npu_verify_mode,
)
from dspark.ascend.emulator import EmulatedGraphBackend, FusedInferAttentionEmulator, emulated_torch_npu
from dspark.ascend.graphs import NpuGraphBackend, VerifyMetadataBuffers
from dspark.ascend.metadata import AscendVerifyMetadata
from dspark.serve.config import EngineConfig
from dspark.util.fileio import atomic_write_text
from dspark.util.options import output_path
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


def tiny_target(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random 2-layer Llama (GQA 4 / 2 heads, head dim 16) through dspark's attention (float16 on an NPU:
    the operator takes float16 / bfloat16 only)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from dspark.models.transformers_lm import TransformersCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rope_theta=1.0e5,
                      tie_word_embeddings=False, initializer_range=0.2, attn_implementation="sdpa")
    return TransformersCausalLM(AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval())


VOCAB, PAGE = 64, 128


def _op(device: str):
    """The operator under test: the CPU emulator, or torch_npu's (None) on an NPU."""
    return FusedInferAttentionEmulator(allow_float32=True) if device != "npu" else None


def model_eager_checks(device: str) -> list[Check]:
    """Rung 1 at model level: the NPU backend decodes what the default attention decodes, every mode."""
    from dspark.serve.drafters.ngram import NgramDrafter
    from dspark.serve.engine import SpecDecoder
    from dspark.serve.policies import Oracle

    target = tiny_target(dtype=torch.float16 if device == "npu" else torch.float32)
    dev = "npu" if device == "npu" else "cpu"
    prompts = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1)).repeat(1, 2)
    checks = []
    for tiers in (None, TIERS):
        for mode in ("static", "cap-accept", "compact"):
            dec = SpecDecoder(target, NgramDrafter(), config=EngineConfig(cache_tokens=4096, page_size=PAGE, device=dev, tiers=tiers))
            want = dec.generate(prompts, 12, Oracle(N - 1), mode=mode)
            with npu_attention(target, _op(device)):
                got = dec.fork().generate(prompts, 12, Oracle(N - 1), mode=mode)
            checks.append(Check(f"NPU backend == default attention: {mode}, {'tiers' if tiers else 'eager'}",
                                torch.equal(got.tokens, want.tokens), f"{got.tokens.tolist()} vs {want.tokens.tolist()}"))
    return checks


def model_graph_checks(device: str) -> list[Check]:
    """Rung 2 at model level: one tier through NpuGraphBackend, successive layouts replay == eager."""
    from dspark.serve.kv_cache import PagedKVCache

    dev = torch.device("npu" if device == "npu" else "cpu")
    target = tiny_target(dtype=torch.float16 if device == "npu" else torch.float32).to(dev)
    g = target.geometry
    cache = PagedKVCache(num_layers=g.num_layers, num_heads=g.num_kv_heads, head_dim=g.head_dim, num_pages=16,
                         page_size=PAGE, device=dev, dtype=target.hf_model.dtype)
    cache.admit(2, 64)
    for buf in (cache.k, cache.v):
        buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(0)))
    saved = sys.modules.get("torch_npu")
    if device != "npu":  # the emulated torch_npu stands in for the graph API and the operator
        sys.modules["torch_npu"] = emulated_torch_npu(_op(device))
    try:
        return _graph_replays(target, cache, device, dev)
    finally:
        if device != "npu":
            sys.modules.pop("torch_npu")
            if saved is not None:
                sys.modules["torch_npu"] = saved


def _graph_replays(target, cache, device: str, dev: torch.device) -> list[Check]:
    from dspark.models.paged_attend import PagedAttend
    from dspark.serve.attention import batch_attention
    from dspark.serve.tier_step import VerifyStep, VerifyStepShape

    g = target.geometry
    table = cache.block_table
    backend = NpuGraphBackend(dev, warmup=0) if device == "npu" else EmulatedGraphBackend(warmup=0)
    with npu_attention(target, _op(device), graph_backend=backend):
        step = VerifyStep(target, cache, VerifyStepShape((8,), width=N, max_requests=2), backend=backend)
    reference = batch_attention(cache, g, 16, 8)
    checks = []
    for lens, prefix in (([4, 4], [5, 9]), ([1, 1], [20, 3]), ([3, 1], [7, 30])):
        layout = step.runner.layout(torch.tensor(lens, dtype=torch.int32, device=dev))
        tokens = torch.randint(0, VOCAB, (layout.graph_num_tokens,), generator=torch.Generator().manual_seed(3)).to(dev)
        k0, v0 = cache.k.clone(), cache.v.clone()
        out = step(tokens, layout, torch.tensor(prefix), table)
        got = out.logits.clone()
        cache.k.copy_(k0)
        cache.v.copy_(v0)
        eager = PagedAttend(reference, cache.k, cache.v, layout, torch.tensor(prefix), table)
        want = target.logits(target(tokens, eager.positions, eager))[: sum(lens)]
        checks.append(Check(f"tier 8 replay of verify_lens {lens} == eager default attention",
                            torch.allclose(got, want, rtol=1e-3, atol=1e-3), f"max diff {float((got - want).abs().max()):.2e}"))
    checks.append(Check("one replay per layout", step.runner.replays[8] == 3, f"{dict(step.runner.replays)}"))
    return checks


def _forward_rows(target, lens: list[int], prefix: list[int], layout, device: str):
    """(logits of the real rows, K/V cache after) of one NPU-backend forward over `layout` (fixed tokens and
    cache contents, so ranks given the same inputs compute the same rows)."""
    from dspark.models.paged_attend import PagedAttend
    from dspark.serve.attention import batch_attention
    from dspark.serve.kv_cache import PagedKVCache

    g = target.geometry
    cache = PagedKVCache(num_layers=g.num_layers, num_heads=g.num_kv_heads, head_dim=g.head_dim, num_pages=16,
                         page_size=PAGE)
    table = cache.admit(max(len(lens), 1), 64)[: len(lens)]
    for buf in (cache.k, cache.v):
        buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(0)))
    tokens = torch.randint(0, VOCAB, (layout.graph_num_tokens,), generator=torch.Generator().manual_seed(5))
    with npu_attention(target, _op(device)):
        attn = batch_attention(cache, g, 32, 16, target.attention_backend)
    before = cache.k.clone()
    attend = PagedAttend(attn, cache.k, cache.v, layout, torch.tensor(prefix, dtype=torch.int64), table)
    logits = target.logits(target(tokens, attend.positions, attend))[: sum(lens)]
    return logits, bool(torch.equal(before, cache.k))


def tp_rank(rank: int, world: int, device: str) -> dict:
    """Rung 3 on one gloo TP rank: agree on verify_lens (hash), then the NPU-backend verify forward."""
    from dspark.parallel import TpAgreement

    lens = torch.tensor([2, 1, 4], dtype=torch.int32)
    agreed = TpAgreement().agree(lens)
    layout = RaggedVerifyLayout.from_verify_lens(agreed, width=N)
    logits, _ = _forward_rows(tiny_target(), agreed.tolist(), [10, 20, 30], layout, device)
    try:
        TpAgreement().agree(torch.tensor([2, 1, 4 - rank], dtype=torch.int32))   # rank 1 disagrees
        caught = False
    except RuntimeError:
        caught = True
    return {"lens": agreed.tolist(), "logits": logits, "disagreement_raised": caught}


def dp_rank(rank: int, world: int, device: str) -> dict:
    """Rung 4 on one gloo DP rank (rank 1 idle): the DP-global tier, then the NPU-backend forward."""
    from dspark.parallel import DpTierAgreement

    lens = torch.tensor([4, 3] if rank == 0 else [], dtype=torch.int32)
    prefix = [10, 20] if rank == 0 else []
    layout, decision = DpTierAgreement(None, TIERS, graph_slots=SLOTS[0], width=N).step(lens)
    logits, untouched = _forward_rows(tiny_target(), lens.tolist(), prefix, layout, device)
    meta = AscendVerifyMetadata.from_layout(layout, prefix, RATIOS)
    return {"tier": decision.tier, "rows": layout.graph_num_tokens, "idle": decision.idle_ranks,
            "logits": logits, "kv_untouched": untouched, "ghost_kv": meta.seq_lens_kv_host[len(prefix):]}


def _gloo(fn, device: str) -> list[dict]:
    """Run `fn` on 2 local gloo ranks (this script's directory on the workers' path)."""
    from dspark.parallel.launch import run_local_gloo

    saved = list(sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # spawned workers start from this path
    try:
        return run_local_gloo(fn, 2, args=(device,), timeout=120)
    finally:
        sys.path[:] = saved


def step1(device: str) -> StepResult:
    res = StepResult(1, "single rank, eager: compact == static at real rows")
    res.cpu_checks = [c for case in CASES for c in eager_case_checks(*case)] + model_eager_checks("cpu")
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
    res.device_checks += model_eager_checks("npu")   # the real operator, float16
    res.reason = "DSV4 attention + compressor (compact == static) is not part of this script"
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
    ] + model_graph_checks("cpu")
    if device != "npu":
        res.reason = "device part (NPU graph capture/replay with task-group updates) needs an NPU"
        return res
    res.device_checks = _graph_replay_checks(torch.device("npu")) + model_graph_checks("npu")
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
    r0, r1 = _gloo(tp_rank, "cpu")
    res.cpu_checks += [
        Check("2 gloo TP ranks: agreed verify_lens identical", r0["lens"] == r1["lens"] == lens),
        Check("2 gloo TP ranks: NPU-backend verify rows identical", torch.equal(r0["logits"], r1["logits"])),
        Check("2 gloo TP ranks: a rank with other verify_lens raises on every rank",
              r0["disagreement_raised"] and r1["disagreement_raised"]),
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
    busy, idle = _gloo(dp_rank, "cpu")
    s4.cpu_checks += [
        Check("2 gloo DP ranks agree on the DP-global tier (rank 1 idle)",
              busy["tier"] == idle["tier"] == 8 and busy["rows"] == idle["rows"] == 8 and busy["idle"] == (1,),
              f"{busy['tier']} / {idle['tier']}, idle {busy['idle']}"),
        Check("the idle rank's forward writes no KV, its slots are ghosts with KV length 1",
              idle["kv_untouched"] and idle["ghost_kv"] == [1] * SLOTS[0] and not busy["kv_untouched"]),
        Check("the busy rank's rows come out of the DP-tier forward", busy["logits"].shape[0] == 7
              and bool(torch.isfinite(busy["logits"]).all())),
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
