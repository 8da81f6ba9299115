"""STS calibration of the shipped draft's confidence head on SmolLM2 (issue 16's "must show").

Loads SmolLM2 and its shipped draft and records greedy STS rows (fixed gamma, every draft verified, so
nothing is censored) on held-out prompts with the teacher-forced recorder: by default at every start
(`record_sts_teacher_forced(starts="all")`: ~tau times the rows of the same decoding work, which a
per-position ECE near 1 % needs), `--starts steps` at the decode loop's own step boundaries (the rows
`record_sts` would record, tests check it), `--recorder decode` with the decode loop itself. Fits
per-position temperatures (NLL; `--ece-fit` also the design note's ECE grid) on 3/4 of the requests and
prints, per draft position and event (cumulative survival, conditional), on the held-out quarter: rows,
ECE (equal-width and equal-mass) before / after calibration next to the ECE noise floor of a perfectly
calibrated predictor with the same probabilities, and the AUROC of the head next to the top-2 draft
logit margin baseline with bootstrap intervals. Writes perf/results/engine_calibration.json.

`--weights` measures another draft file for the same target (default: the shipped one).

    PYTHONPATH=. python perf/engine_calibration.py [--prompts 1024] [--new-tokens 32] [--gamma 4] [--weights F]
"""
from __future__ import annotations

import argparse
import math
import platform
import tempfile
import time
from pathlib import Path

import torch

from dspark.calibration.fit import fit_sts
from dspark.cli.options import at_least, output_path
from dspark.engine.decode import SpecDecoder
from dspark.engine.demo import load_models
from dspark.engine.sts import STARTS, record_sts, record_sts_teacher_forced
from dspark.models.corpus import prompt_windows
from dspark.models.draft import DEFAULT_WEIGHTS, file_sha256, load_draft
from dspark.util.fileio import write_json_atomic


def _finite_or_none(x: object) -> object:
    """NaN -> None (strict JSON), recursively."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_none(v) for v in x]
    return x


def _row(pos: dict, event: str) -> dict:
    e = pos[event]
    v = lambda block, name: e[block][name]["value"]  # noqa: E731
    rel = e["reliability"]["after"]
    count = sum(rel["count"])
    mean = lambda key: sum(x * c for x, c in zip(rel[key], rel["count"]) if c) / count  # noqa: E731
    return {"position": pos["position"], "event": event, "rows": e["rows"],
            "mean_p_after": mean("mean_p"), "accept_rate": mean("freq"),
            "ece_width_before": v("before", "ece_width"), "ece_width_after": v("after", "ece_width"),
            "ece_width_floor": e["ece_floor_after"]["width"],
            "ece_mass_before": v("before", "ece_mass"), "ece_mass_after": v("after", "ece_mass"),
            "ece_mass_floor": e["ece_floor_after"]["mass"],
            "auroc_head": v("after", "auroc"), "auroc_head_ci": e["after"]["auroc"]["ci"],
            "auroc_margin": e.get("auroc_margin", {}).get("value", float("nan")),
            "auroc_margin_ci": e.get("auroc_margin", {}).get("ci", [float("nan")] * 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recorder", choices=("teacher_forced", "decode"), default="teacher_forced")
    ap.add_argument("--starts", choices=STARTS, default="all", help="teacher-forced recorder: rows recorded")
    ap.add_argument("--prompts", type=at_least(1), default=None,
                    help="held-out prompts recorded (requests); default 1024 (teacher_forced), 128 (decode)")
    ap.add_argument("--new-tokens", type=at_least(1), default=32, help="prompt-len + new-tokens + gamma + 1 <= 128")
    ap.add_argument("--prompt-len", type=at_least(1), default=32)
    ap.add_argument("--gamma", type=at_least(1), default=4, help="drafts per step (the demo's 4; the draft proposes up to 6)")
    ap.add_argument("--bootstrap", type=at_least(0), default=100)
    ap.add_argument("--seed", type=at_least(0), default=1)
    ap.add_argument("--threads", type=at_least(1), default=1)
    ap.add_argument("--ece-fit", action="store_true", help="also fit with the ECE grid search (held-out ECE only)")
    ap.add_argument("--weights", type=Path, default=None, help=f"draft file (default {DEFAULT_WEIGHTS})")
    ap.add_argument("--out", type=output_path(), default="perf/results/engine_calibration.json")
    args = ap.parse_args()
    if args.prompts is None:
        args.prompts = 1024 if args.recorder == "teacher_forced" else 128
    torch.set_num_threads(args.threads)

    target, draft, encode = load_models(torch.device("cpu"))
    if args.weights is not None:
        draft = load_draft(target, args.weights)
    decode_loop = args.recorder == "decode"
    decoder = SpecDecoder(target, draft, cache_tokens=(args.prompts if decode_loop else 1) * 1024)
    prompts = prompt_windows("heldout", encode, args.prompts, args.prompt_len, args.seed)
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if decode_loop:
            data = record_sts(decoder, prompts, args.gamma, args.new_tokens, Path(tmp), seed=args.seed)
        else:
            data = record_sts_teacher_forced(decoder, prompts, args.gamma, args.new_tokens, Path(tmp),
                                             starts=args.starts)
    t2 = time.perf_counter()
    calib = fit_sts(data, policy="greedy", method="nll", bootstrap=args.bootstrap, seed=args.seed)
    t3 = time.perf_counter()
    ece_fit = fit_sts(data, policy="greedy", method="ece", bootstrap=0, seed=args.seed) if args.ece_fit else None

    rows = [_row(p, ev) for ev in ("cumulative", "conditional") for p in calib.metrics["positions"] if p[ev]]
    source = "decode loop" if decode_loop else f"teacher-forced, starts={args.starts}"
    print(f"SmolLM2 + shipped draft; recorded {data.num_rows} rows ({source}; "
          f"{args.prompts} prompts x {args.new_tokens} new tokens, gamma {args.gamma}) in {t2 - t1:.1f}s; "
          f"fit+report {t3 - t2:.1f}s; held-out {calib.data['heldout_rows']} rows / "
          f"{calib.data['heldout_requests']} requests")
    at_bound = [w for w in calib.warnings if "search bound" in w]
    where = "at a search bound" if at_bound else "inside the search bounds"
    print(f"temperatures: {[round(t, 3) for t in calib.temperatures]} ({where})")
    print(f"{'event':<12}{'k':>2}{'rows':>6} | {'ECEw before':>11}{'after':>7}{'floor':>7} | "
          f"{'ECEm before':>11}{'after':>7}{'floor':>7} | {'AUROC head [95% CI]':>21}{'margin [95% CI]':>22} | "
          f"{'mean p':>6}{'rate':>6}")
    ci = lambda v, c: f"{v:.3f} [{c[0]:.3f},{c[1]:.3f}]"  # noqa: E731
    for r in rows:
        print(f"{r['event']:<12}{r['position']:>2}{r['rows']:>6} | {r['ece_width_before']:>11.4f}"
              f"{r['ece_width_after']:>7.4f}{r['ece_width_floor']:>7.4f} | {r['ece_mass_before']:>11.4f}"
              f"{r['ece_mass_after']:>7.4f}{r['ece_mass_floor']:>7.4f} | {ci(r['auroc_head'], r['auroc_head_ci']):>21}"
              f"{ci(r['auroc_margin'], r['auroc_margin_ci']):>22} | {r['mean_p_after']:>6.3f}{r['accept_rate']:>6.3f}")
    ece_rows = None
    if ece_fit is not None:
        ece_rows = [_row(p, "cumulative") for p in ece_fit.metrics["positions"] if p["cumulative"]]
        print(f"ECE-grid fit: temperatures {[round(t, 3) for t in ece_fit.temperatures]}; held-out cumulative ECE "
              f"after (width / mass): " + ", ".join(f"k{r['position']} {r['ece_width_after']:.4f} / "
                                                     f"{r['ece_mass_after']:.4f}" for r in ece_rows))
    cum = [r for r in rows if r["event"] == "cumulative"]
    met = all(max(r["ece_width_after"], r["ece_mass_after"]) <= 0.01 for r in cum)
    better = [r["position"] for r in cum if r["auroc_head"] > r["auroc_margin"]]
    print(f"ECE after <= 1% at every position (cumulative, both binnings): {met}; "
          f"head ranks better than the margin baseline at positions {better} of {len(cum)}")
    for w in calib.warnings:
        print(f"warning: {w}")
    write_json_atomic(args.out, _finite_or_none({
        "command": "PYTHONPATH=. python perf/engine_calibration.py " + " ".join(
            f"--{k.replace('_', '-')}" + ("" if isinstance(v, bool) else f" {v}")
            for k, v in vars(args).items() if k != "out" and v is not False and v is not None),
        "draft_sha256": file_sha256(args.weights or DEFAULT_WEIGHTS),
        "platform": platform.machine(), "threads": args.threads, "source": source,
        "record_seconds": t2 - t1, "fit_seconds": t3 - t2, "rows": data.num_rows,
        "temperatures": calib.temperatures, "data": calib.data, "table": rows,
        "ece_le_1pct_every_position": met, "temperature_at_bound": bool(at_bound),
        "head_better_than_margin_positions": better,
        "warnings": calib.warnings,
        "ece_fit": None if ece_fit is None else {"temperatures": ece_fit.temperatures, "table": ece_rows,
                                                 "warnings": ece_fit.warnings}}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
