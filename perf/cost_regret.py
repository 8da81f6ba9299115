"""Cost-model regret: the throughput each model's budget argmax loses against a dense oracle, side by side.

Every survival matrix goes through `dspark.plan.budget.choose_budget` once per cost model (1-D floor table,
additive, tiered) and through the oracle's exact argmax of tau(b) / T_true(B, B*F + b). Per model:
mean / p90 / max of the throughput loss 1 - theta_true(b_model) / theta_true(b_oracle), and the rate
of decisions whose replayed tier differs from the oracle's.

Cost sources (one per run):
  default        a synthetic staircase (documented in perf/README.md): T_true(B, M) = base + per_request*B
                 + per_row*tier(M) + per_real_row*M; the models are fitted on noisy samples of it (tier
                 tops, tier+-2, B*F, B*W; 1-D on the static diagonal only), the oracle is T_true itself.
  --sweep PATH   a `perf/tier_sweep.py --dense` result: the models it fitted, the dense measured medians
                 as the oracle.
Survival sources: synthetic matrices (always) and, with --survival FILE, recorded ones (torch.save of a
[N, B, gamma] tensor or a list of [B, gamma] tensors).

  python perf/cost_regret.py
  python perf/cost_regret.py --sweep graphs/block-d64-ctx32-cpu-W8.sweep.json
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor

from dspark.config import ScheduleConfig
from dspark.cost import CostModel, ProfileSample
from dspark.lab.sweep import budget_regret, dense_rows, fit_cost_models, tier_rows
from dspark.util.fileio import read_json, write_json_atomic
from dspark.util.options import NONNEGATIVE_REAL, at_least, int_list, output_path, real
from dspark.verify.layout import round_up_to_tier

Oracle = Callable[[int, Tensor], Tensor]
DEFAULT_TIERS = [8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]
DEFAULT_BATCHES = [1, 2, 4, 8, 16, 24, 32, 48, 64]


def staircase(tiers: Sequence[int], base: float, per_request: float, per_row: float, per_real_row: float) -> Oracle:
    """T_true(B, M) = base + per_request*B + per_row*tier(M) + per_real_row*M (seconds); +inf past the
    largest tier. The last term (real rows cost a little more than padding rows, e.g. attention over
    their KV) is one the tiered model cannot represent: it keeps the comparison honest."""
    def seconds(b: int, rows: Tensor) -> Tensor:
        tier = torch.tensor([round_up_to_tier(int(m), tiers) or 0 for m in rows.tolist()], dtype=torch.float64)
        out = base + per_request * b + per_row * tier + per_real_row * rows.to(torch.float64)
        return torch.where(tier > 0, out, torch.full_like(out, torch.inf))

    return seconds


def synthetic_samples(oracle: Oracle, tiers: Sequence[int], batches: Sequence[int], width: int,
                      noise: float, gen: torch.Generator) -> list[ProfileSample]:
    """Noisy measurements of the staircase at the sweep's pinned points (multiplicative Gaussian noise)."""
    out = []
    for b in batches:
        rows = torch.tensor([m for m in tier_rows(tiers, b, width) if m <= tiers[-1]])
        true = oracle(b, rows)
        noisy = true * (1 + noise * torch.randn(rows.numel(), generator=gen, dtype=torch.float64))
        out += [ProfileSample(b, int(m), float(t)) for m, t in zip(rows.tolist(), noisy.tolist())]
    return out


def measured_oracle(samples: Sequence[ProfileSample], batches: Sequence[int], width: int) -> Oracle:
    """The dense measured medians as T_true; refuses a sweep that lacks any row count of a batch size."""
    table = {(s.num_requests, s.rows): s.seconds for s in samples}
    for b in batches:
        missing = [m for m in dense_rows(b, width) if (b, m) not in table]
        if missing:
            raise SystemExit(f"sweep lacks dense samples for B={b} (rows {missing[:5]}...); "
                             "rerun tier_sweep.py --dense")

    def seconds(b: int, rows: Tensor) -> Tensor:
        if b not in batches:
            raise SystemExit(f"survival with B={b} requests, but the sweep measured only B in {list(batches)}")
        return torch.tensor([table[(b, int(m))] for m in rows.tolist()], dtype=torch.float64)

    return seconds


def synthetic_survival(batches: Sequence[int], per_batch: int, gamma: int, lo: float, hi: float,
                       gen: torch.Generator) -> list[Tensor]:
    """Per request an acceptance level p ~ U(lo, hi), conditional confidences p + N(0, 0.05) clipped,
    survival = their running product."""
    out = []
    for b in batches:
        for _ in range(per_batch):
            level = lo + (hi - lo) * torch.rand(b, 1, generator=gen)
            cond = (level + 0.05 * torch.randn(b, gamma, generator=gen)).clamp(0.0, 1.0)
            out.append(torch.cumprod(cond, dim=1))
    return out


def recorded_survival(path: Path, gamma: int) -> list[Tensor]:
    obj = torch.load(path, map_location="cpu")
    mats = list(obj.unbind(0)) if isinstance(obj, Tensor) and obj.dim() == 3 else obj
    if not isinstance(mats, list) or not all(isinstance(m, Tensor) and m.dim() == 2 for m in mats):
        raise SystemExit(f"{path}: expected a [N, B, gamma] tensor or a list of [B, gamma] tensors")
    bad = [tuple(m.shape) for m in mats if m.shape[1] != gamma]
    if bad:
        raise SystemExit(f"{path}: survival must have gamma={gamma} columns, got shapes {bad[:3]}")
    return [m.to(torch.float32) for m in mats]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", type=Path, default=None, help="a tier_sweep.py --dense result (default: synthetic)")
    ap.add_argument("--survival", type=Path, default=None, help="recorded survival matrices (torch.save)")
    ap.add_argument("--tiers", type=int_list(1), default=DEFAULT_TIERS, help="synthetic staircase tiers")
    ap.add_argument("--batches", type=int_list(1), default=DEFAULT_BATCHES, help="synthetic batch sizes")
    ap.add_argument("--width", type=at_least(1), default=8, help="synthetic W = gamma + 1")
    ap.add_argument("--base-ms", type=NONNEGATIVE_REAL, default=1.0)
    ap.add_argument("--per-request-ms", type=NONNEGATIVE_REAL, default=0.02)
    ap.add_argument("--per-row-ms", type=NONNEGATIVE_REAL, default=0.006, help="cost per row of the replayed tier")
    ap.add_argument("--per-real-row-ms", type=NONNEGATIVE_REAL, default=0.0005, help="extra cost per real (non-padding) row")
    ap.add_argument("--noise", type=NONNEGATIVE_REAL, default=0.005,
                    help="relative noise of each synthetic sample (a median over repeats)")
    ap.add_argument("--row-bin", type=at_least(1), default=64, help="additive model M bin (synthetic)")
    ap.add_argument("--per-batch", type=at_least(1), default=300, help="synthetic survival matrices per batch size")
    ap.add_argument("--accept", type=real(0.0, 1.0, low_open=True), nargs=2, default=(0.3, 0.95), metavar=("LO", "HI"))
    ap.add_argument("--seed", type=at_least(0), default=0)
    ap.add_argument("--out", type=output_path(), default="perf/results/cost_regret.json")
    args = ap.parse_args(argv)
    if not args.accept[0] < args.accept[1]:
        ap.error(f"--accept LO HI needs LO < HI, got {list(args.accept)}")
    gen = torch.Generator().manual_seed(args.seed)

    if args.sweep is None:
        tiers, batches, width = args.tiers, args.batches, args.width
        oracle = staircase(tiers, args.base_ms * 1e-3, args.per_request_ms * 1e-3, args.per_row_ms * 1e-3,
                           args.per_real_row_ms * 1e-3)
        samples = synthetic_samples(oracle, tiers, batches, width, args.noise, gen)
        models = fit_cost_models(samples, tiers=tiers, width=width, platform="synthetic", row_bin=args.row_bin)
        source = {"kind": "synthetic staircase", "base_ms": args.base_ms, "per_request_ms": args.per_request_ms,
                  "per_row_ms": args.per_row_ms, "per_real_row_ms": args.per_real_row_ms, "noise": args.noise,
                  "row_bin": args.row_bin,
                  "num_samples": len(samples)}
    else:
        sweep = read_json(args.sweep)
        tiers, batches, width = sweep["tiers"], sweep["batches"], sweep["width"]
        samples = [ProfileSample(s["num_requests"], s["rows"], s["seconds"]) for s in sweep["samples"]]
        oracle = measured_oracle(samples, batches, width)
        models = {n: CostModel.from_dict(d) for n, d in sweep["models"].items()}
        source = {"kind": "measured sweep", "path": str(args.sweep), "platform": sweep["platform"],
                  "adapter": sweep["adapter"], "command": sweep["command"]}

    cfg = ScheduleConfig(gamma=width - 1)
    survivals = {"synthetic": synthetic_survival(batches, args.per_batch, cfg.gamma, *args.accept, gen)}
    if args.survival is not None:
        survivals["recorded"] = recorded_survival(args.survival, cfg.gamma)
    results = {name: budget_regret(mats, models, oracle, cfg=cfg, tiers=tiers) for name, mats in survivals.items()}

    print(f"cost regret vs the dense oracle ({source['kind']}); tiers {tiers}, B {batches}, W {width}")
    print(f"{'survival':<10} {'model':<12} {'mean loss':>10} {'p90 loss':>10} {'max loss':>10} "
          f"{'wrong tier':>11} {'n':>6}")
    for sname, per_model in results.items():
        for mname, r in per_model.items():
            print(f"{sname:<10} {mname:<12} {r.mean:>10.3%} {r.p90:>10.3%} {r.max:>10.3%} {r.wrong_tier_rate:>11.1%} "
                  f"{r.num_decisions:>6}")
    record = {"command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
              "source": source, "tiers": tiers, "batches": batches, "width": width,
              "accept_range": list(args.accept), "per_batch": args.per_batch, "seed": args.seed,
              "models": {n: m.to_dict() for n, m in models.items()},
              "regret": {s: {m: dataclasses.asdict(r) for m, r in pm.items()} for s, pm in results.items()}}
    print(f"wrote {write_json_atomic(args.out, record)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
