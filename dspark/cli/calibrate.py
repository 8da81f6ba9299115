"""`dspark calibrate SHARDS... --out calib.json [--plots DIR]`: fit STS temperatures from recorded shards."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from dspark.calibration.fit import METHODS, FitOptions, fit_sts
from dspark.calibration.recorder import POLICIES, load_sts
from dspark.lab.progress import StageProgress
from dspark.util.validate import check_output_path

HELP = "fit STS temperatures from recorded confidence shards (StsRecorder output)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `calibrate` sub-command's arguments (registered by `dspark.cli`)."""
    p.add_argument("shards", nargs="+", help="shard files or directories of shards (StsRecorder output)")
    p.add_argument("--out", required=True, help="calibration JSON to write")
    p.add_argument("--plots", default=None, help="directory for reliability diagrams (one PNG per position)")
    p.add_argument("--policy", choices=POLICIES, default=None,
                   help="acceptance policy to fit (required when the shards mix policies)")
    p.add_argument("--method", choices=METHODS, default="nll", help="fit objective (default: nll)")
    p.add_argument("--bounds", type=float, nargs=2, default=(0.05, 20.0), metavar=("LOW", "HIGH"),
                   help="temperature search bounds")
    p.add_argument("--bins", type=int, default=15, help="ECE bins")
    p.add_argument("--holdout", type=float, default=0.25, help="fraction of requests held out")
    p.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples for the intervals")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    """Check the options and outputs, load shards, fit, write the plots and the JSON, print a per-position
    summary."""
    options = FitOptions(method=args.method, bounds=tuple(args.bounds), num_bins=args.bins,
                         holdout_fraction=args.holdout, bootstrap=args.bootstrap, seed=args.seed)
    check_output_path("--out", args.out)
    if args.plots:
        check_output_path("--plots", args.plots, folder=True)
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plots needs matplotlib: pip install 'dspark[plot]' (or leave out --plots)")
    progress = StageProgress()
    data = load_sts(args.shards, progress=lambda i, n, _p: progress("load", i, n))
    calib = fit_sts(data, options, policy=args.policy, progress=progress)
    print("held-out, cumulative event; ECE floor = ECE a perfectly calibrated predictor gets on this many rows")
    print(f"{'pos':>3} {'T':>8} {'rows':>7} {'ECE before':>11} {'ECE after':>10} {'ECE floor':>10} {'AUROC head':>11} "
          f"{'AUROC margin':>13}")
    for pos in calib.metrics["positions"]:
        rep = pos["cumulative"]
        if rep is None:
            continue
        margin = rep.get("auroc_margin", {}).get("value", float("nan"))
        print(f"{pos['position']:>3} {calib.temperatures[pos['position']]:>8.4f} {rep['rows']:>7} "
              f"{rep['before']['ece_width']['value']:>11.4f} {rep['after']['ece_width']['value']:>10.4f} "
              f"{rep['ece_floor_after']['width']:>10.4f} {rep['after']['auroc']['value']:>11.4f} {margin:>13.4f}")
    for w in calib.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.plots:
        from dspark.calibration.plots import plot_reliability

        paths = plot_reliability(calib, Path(args.plots))
        print(f"wrote {len(paths)} reliability diagrams to {args.plots}")
    calib.save(args.out)  # last: the JSON's presence means the whole run finished
    print(f"wrote {args.out}: policy {calib.policy}, {calib.data['rows']} rows, "
          f"{calib.data['heldout_requests']} held-out requests")
    return 0
