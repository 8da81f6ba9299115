"""Tier sweep: profile a verify step over B x rows, fit the 1-D, additive and tiered cost models side by side.

The step is the engine's own verify forward (`dspark.lab.sweep.VerifyStepAdapter`: a transformers
causal LM over the paged KV cache, captured per tier by `TierGraphRunner`: CUDA graphs on cuda, eager at the
padded tier shape on the CPU) of `--model smollm2` (SmolLM2-135M-Instruct, `dspark.models.load_smollm2`) or
`--model tiny` (the engine tests' random 2-layer Llama; needs the repo root on PYTHONPATH), with `--context`
cached tokens per request.

Rows are pinned at every tier top and at tier-2 .. tier+2 (plus B*F and the static point B*W); with
--dense every row count in [B*F, B*W] is measured too (the oracle `perf/cost_regret.py` judges against).
The models are fitted on the pinned samples only. Writes to --out (default graphs/):
  <name>.sweep.json      raw samples (median seconds per point) + the three fitted models + tier-edge errors
  <name>.<model>.json    each fitted cost model (steps_per_second, additive, tiered, tiered_dense),
                         loadable with dspark.load_cost_model
  <name>.tiers.json      the tier manifest of the runner that was profiled (when the adapter has one)
  <name>.png             measured vs predicted cost per B, tiers marked

  python perf/tier_sweep.py --dense                                  # SmolLM2's verify step, CPU
  PYTHONPATH=. python perf/tier_sweep.py --model tiny --dense         # the tests' tiny Llama
  python perf/tier_sweep.py --adapter mypkg.mod:make_adapter --device cuda
The adapter factory is called as factory(tiers=, width=, max_requests=, device=) and returns a
`dspark.lab.sweep.StepAdapter` (prepare(num_requests, rows) / step()).
"""
from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from dspark.cost import CostModel, ProfileSample, tier_edge_errors
from dspark.lab.progress import StageProgress
from dspark.lab.sweep import (
    STATS,
    StepAdapter,
    SweepCache,
    SweepTiming,
    VerifyStepAdapter,
    dense_rows,
    fit_cost_models,
    profile_steps,
    tier_rows,
)
from dspark.serve.clock import CLOCKS
from dspark.serve.tier_step import VerifyStepShape
from dspark.util.fileio import atomic_write, write_json_atomic
from dspark.util.options import at_least, int_list, output_path, usable_device
from dspark.verify.layout import check_tiers

SWEEP_SCHEMA = "dspark.tier_sweep"
SWEEP_VERSION = 1
FILE_STEMS = {"1-D": "steps_per_second"}  # model name -> file stem (default: the name, '-' -> '_')


def load_target(model: str):
    """The `--model` target: SmolLM2-135M-Instruct or the engine tests' tiny random Llama."""
    if model == "smollm2":
        from dspark.models import load_smollm2

        return load_smollm2()[0]
    from dspark.models.transformers_lm import TransformersCausalLM
    from tests.engine_models import tiny_llama  # the repo root on PYTHONPATH

    return TransformersCausalLM(tiny_llama())


def make_adapter(spec: str, args: argparse.Namespace, device: torch.device) -> StepAdapter:
    """`model` (the engine's verify step of `--model`) or `module:factory` for a user's model."""
    common = {"tiers": args.tiers, "width": args.width, "max_requests": max(args.batches), "device": device}
    if spec == "model":
        shape = VerifyStepShape(args.tiers, args.width, max(args.batches))
        return VerifyStepAdapter(load_target(args.model), shape, SweepCache(args.context, seed=args.seed),
                                 device=device)
    mod, _, attr = spec.partition(":")
    factory: Callable[..., StepAdapter] = getattr(importlib.import_module(mod), attr)
    return factory(**common)


def sweep_points(tiers: Sequence[int], batches: Sequence[int], width: int, dense: bool) -> tuple[list, set]:
    pinned = {(b, m) for b in batches for m in tier_rows(tiers, b, width)}
    every = {(b, m) for b in batches for m in dense_rows(b, width)} if dense else set()
    return sorted(pinned | every), pinned


def plot(path: Path, samples: Sequence[ProfileSample], pinned: set, models: dict[str, CostModel],
         tiers: Sequence[int], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({s.num_requests for s in samples})
    cols = min(3, len(batches))
    nrows = -(-len(batches) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.6 * nrows), squeeze=False)
    for ax, b in zip(axes.flat, batches):
        mine = sorted((s for s in samples if s.num_requests == b), key=lambda s: s.rows)
        rows = torch.tensor([s.rows for s in mine])
        ax.scatter(rows, [s.seconds * 1e3 for s in mine], s=6, c="0.55", label="measured")
        pin = [s for s in mine if (s.num_requests, s.rows) in pinned]
        ax.scatter([s.rows for s in pin], [s.seconds * 1e3 for s in pin], s=16, c="k", marker="x", label="pinned (fit)")
        dense = torch.arange(int(rows.min()), int(rows.max()) + 1)
        for name, model in models.items():
            ax.step(dense, model.step_seconds(b, dense) * 1e3, where="mid", lw=1.2, label=name)
        for t in tiers:
            if dense[0] <= t <= dense[-1]:
                ax.axvline(t, color="0.8", ls=":", lw=0.8)
        ax.set_title(f"B = {b}")
        ax.set_xlabel("verify rows M (tiers dotted)")
        ax.set_ylabel("step ms")
    for ax in list(axes.flat)[len(batches):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """The options argparse's types cannot check alone, before the target loads (a usage error naming the
    option); the device."""
    try:
        check_tiers(args.tiers)
        if args.name is not None and (Path(args.name).name != args.name or args.name in ("", ".", "..")):
            raise ValueError(f"--name is a file stem (no folders: use --out), got {args.name!r}")
        device = usable_device(args.device)
    except ValueError as e:
        ap.error(f"--{e}" if str(e).startswith("device") else str(e))
    if args.adapter != "model" and not args.adapter.partition(":")[2]:
        ap.error(f"--adapter must be 'model' or 'module:factory', got {args.adapter!r}")
    return device


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--adapter", default="model", help="'model' (the engine's verify step of --model) or "
                                                       "module:factory")
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                    help="target of --adapter model: SmolLM2-135M-Instruct or the tests' tiny random Llama")
    ap.add_argument("--tiers", type=int_list(1), default=[8, 16, 24, 32, 48, 64, 80, 96, 112, 128])
    ap.add_argument("--width", type=at_least(1), default=8, help="W = gamma + 1")
    ap.add_argument("--batches", type=int_list(1), default=[1, 2, 4, 8, 12, 16])
    ap.add_argument("--dense", action="store_true", help="also measure every row count (the regret oracle)")
    ap.add_argument("--repeats", type=at_least(1), default=7)
    ap.add_argument("--warmup", type=at_least(0), default=1)
    ap.add_argument("--inner", type=at_least(1), default=1, help="steps per timing (their mean is one repeat)")
    ap.add_argument("--stat", choices=sorted(STATS), default="median",
                    help="over repeats: median, or min (contention only slows a step: use on a shared box)")
    ap.add_argument("--threads", type=at_least(1), default=1, help="CPU intra-op threads (1: least noise on a shared box)")
    ap.add_argument("--clock", choices=CLOCKS, default="wall",
                    help="CPU timer: wall (perf_counter) or thread (thread CPU time; with --threads 1 on a "
                         "shared box)")
    ap.add_argument("--context", type=at_least(0), default=32, help="cached tokens per request (--adapter model)")
    ap.add_argument("--row-bin", type=at_least(1), default=64, help="additive model M bin (the profiler default)")
    ap.add_argument("--seed", type=at_least(0), default=0)
    ap.add_argument("--name", default=None, help="file stem (default: <adapter name>-<platform>-W<W>)")
    ap.add_argument("--out", type=output_path(folder=True), default="graphs")
    args = ap.parse_args(argv)
    device = check_args(ap, args)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    adapter = make_adapter(args.adapter, args, device)
    name = args.name or f"{adapter.name}-{device.type}-W{args.width}"
    points, pinned = sweep_points(args.tiers, args.batches, args.width, args.dense)
    print(f"tier sweep of {adapter.name} on {device}: {len(points)} points ({len(pinned)} pinned) x "
          f"{args.repeats} repeats of {args.inner}, tiers {args.tiers}, B {args.batches}, W {args.width}, "
          f"clock {args.clock}, {args.stat} over repeats")
    t0 = time.perf_counter()
    timing = SweepTiming(warmup=args.warmup, repeats=args.repeats, inner=args.inner, seed=args.seed,
                         clock=args.clock, stat=args.stat)
    samples = profile_steps(adapter, points, timing=timing,
                            progress=lambda done, total, bar=StageProgress(): bar("steps", done, total))
    elapsed = time.perf_counter() - t0
    fit_on = [s for s in samples if (s.num_requests, s.rows) in pinned]
    models = fit_cost_models(fit_on, tiers=args.tiers, width=args.width, platform=device.type,
                             row_bin=args.row_bin)
    inside = [s for s in samples if s.rows <= args.tiers[-1]]  # past the largest tier a step runs eager
    edges = {n: tier_edge_errors(m, inside, args.tiers) for n, m in models.items()}

    print(f"\n{'model':<12} {'fit RMS us':>10} {'fit R^2':>8} {'all-pts mean|err|':>18} {'max |err| at tier+-2':>21}")
    for n, m in models.items():
        err = [abs(float(m.step_seconds(s.num_requests, s.rows)) / s.seconds - 1) for s in inside]
        worst = max(abs(e) for per in edges[n].values() for e in per.values())
        print(f"{n:<12} {m.fit_report.rms * 1e6:>10.2f} {m.fit_report.r2:>8.4f} {sum(err) / len(err):>17.2%} "
              f"{worst:>20.2%}")

    out = Path(args.out)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    record = {
        "schema": SWEEP_SCHEMA, "version": SWEEP_VERSION, "command": command, "adapter": adapter.name,
        "platform": device.type, "width": args.width, "tiers": args.tiers, "batches": args.batches,
        "repeats": args.repeats, "inner": args.inner, "warmup": args.warmup, "stat": args.stat,
        "threads": args.threads if device.type == "cpu" else None,
        "clock": args.clock if device.type == "cpu" else "device events",
        "dense": args.dense, "sweep_seconds": elapsed,
        "samples": [{"num_requests": s.num_requests, "rows": s.rows, "seconds": s.seconds,
                     "pinned": (s.num_requests, s.rows) in pinned} for s in samples],
        "models": {n: m.to_dict() for n, m in models.items()},
        "tier_edge_error": edges,
    }
    written = [write_json_atomic(out / f"{name}.sweep.json", record)]
    written += [m.save(out / f"{name}.{FILE_STEMS.get(n, n.replace('-', '_'))}.json") for n, m in models.items()]
    runner = getattr(adapter, "runner", None)
    if runner is not None:
        written.append(runner.manifest.save(out / f"{name}.tiers.json"))
    png = out / f"{name}.png"
    plot(png, samples, pinned, models, args.tiers,
         f"{adapter.name} on {device.type}, W={args.width}: measured vs predicted")
    written.append(png)
    print(f"\nsweep took {elapsed:.1f} s; wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
