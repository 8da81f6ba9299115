"""STS calibration cost and quality on synthetic data with known per-position temperatures.

Side by side for the fit objectives (nll, brier, ece): fit time, relative temperature error, held-out
ECE after calibration; plus the recorder's per-step `record` cost and the held-out evaluation cost.
Medians over repeats. Writes perf/results/calibration_fit.json.

    PYTHONPATH=. python perf/calibration_fit.py [--rows 40000] [--gamma 7] [--repeats 3] [--bootstrap 200]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from dspark.calibration.evaluate import evaluate
from dspark.calibration.fit import fit_temperatures, split_by_request
from dspark.calibration.recorder import StsOutcome, StsRecorder, load_sts
from dspark.util.fileio import atomic_write_text
from dspark.util.options import at_least, output_path


def synthetic_steps(rows: int, temps: torch.Tensor, batch: int, seed: int):
    """Per-step tensors as a decode loop would hand them to the recorder (true c = sigmoid(z / T))."""
    g = temps.numel()
    gen = torch.Generator().manual_seed(seed)
    for s in range(0, rows, batch):
        z = torch.randn(batch, g, generator=gen) * 2.5 + 3.0
        acc = torch.rand(batch, g, generator=gen) < torch.sigmoid(z / temps)
        yield dict(confidence_logits=z, verify_lens=torch.randint(2, g + 2, (batch,), generator=gen),
                   request_ids=torch.arange(s, s + batch) // 16,
                   outcome=StsOutcome(correct_lens=torch.cumprod(acc.int(), 1).sum(1)),
                   draft_logits=torch.randn(batch, g, 32, generator=gen))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=at_least(1), default=40_000)
    ap.add_argument("--gamma", type=at_least(1), default=7)
    ap.add_argument("--batch", type=at_least(1), default=64, help="requests per recorded step")
    ap.add_argument("--repeats", type=at_least(1), default=3)
    ap.add_argument("--bootstrap", type=at_least(0), default=200)
    ap.add_argument("--out", type=output_path(), default="perf/results/calibration_fit.json")
    args = ap.parse_args()
    temps = torch.linspace(0.5, 2.0, args.gamma)

    with tempfile.TemporaryDirectory() as tmp:
        rec = StsRecorder(tmp, gamma=args.gamma, shard_rows=16_384)
        record_s = []
        for step in synthetic_steps(args.rows, temps, args.batch, seed=0):
            t0 = time.perf_counter()
            rec.record(**step)
            record_s.append(time.perf_counter() - t0)
        rec.close()
        t0 = time.perf_counter()
        data = load_sts([tmp])
        load_s = time.perf_counter() - t0

    held = split_by_request(data.request_ids, 0.25, 0)
    train, test = data.select(~held), data.select(held)
    rows = []
    for method in ("nll", "brier", "ece"):
        times, fits = [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fits = fit_temperatures(train.logits, train.labels, method=method)
            times.append(time.perf_counter() - t0)
        got = torch.tensor([f.temperature for f in fits])
        t0 = time.perf_counter()
        rep = evaluate(test, got.tolist(), bootstrap=args.bootstrap)
        eval_s = time.perf_counter() - t0
        ece_after = [p["cumulative"]["after"]["ece_width"]["value"] for p in rep["positions"]]
        ece_before = [p["cumulative"]["before"]["ece_width"]["value"] for p in rep["positions"]]
        per_position = [{"position": p["position"], "heldout_rows": p["cumulative"]["rows"],
                         "ece_before": b, "ece_after": a, "ece_after_ci": p["cumulative"]["after"]["ece_width"]["ci"],
                         "ece_floor": p["cumulative"]["ece_floor_after"]["width"]}
                        for p, b, a in zip(rep["positions"], ece_before, ece_after)]
        rows.append({"method": method, "per_position": per_position, "fit_s_median": statistics.median(times), "eval_s": eval_s,
                     "max_rel_temp_error": float((got / temps - 1).abs().max()),
                     "max_ece_before": max(ece_before), "max_ece_after": max(ece_after),
                     "temperatures": got.tolist()})

    print(f"rows {data.num_rows} (train {train.num_rows}, held-out {test.num_rows}), gamma {args.gamma}, "
          f"true T {[round(t, 3) for t in temps.tolist()]}")
    print(f"record(): median {statistics.median(record_s) * 1e3:.3f} ms per step of {args.batch} requests; "
          f"load {load_s:.2f} s")
    print(f"{'method':>6} {'fit s':>8} {'eval s':>8} {'max |T/T*-1|':>13} {'max ECE before':>15} {'max ECE after':>14}")
    for r in rows:
        print(f"{r['method']:>6} {r['fit_s_median']:>8.3f} {r['eval_s']:>8.2f} {r['max_rel_temp_error']:>13.4f} "
              f"{r['max_ece_before']:>15.4f} {r['max_ece_after']:>14.4f}")
    print(f"{'pos':>3} {'held-out rows':>13} {'ECE before':>11} {'ECE after (nll)':>16} {'bootstrap CI':>18} "
          f"{'ECE floor':>10}")
    for p in rows[0]["per_position"]:
        lo, hi = p["ece_after_ci"]
        print(f"{p['position']:>3} {p['heldout_rows']:>13} {p['ece_before']:>11.4f} {p['ece_after']:>16.4f} "
              f"{f'[{lo:.4f}, {hi:.4f}]':>18} {p['ece_floor']:>10.4f}")
    out = atomic_write_text(args.out, json.dumps({
        "args": vars(args), "true_temperatures": temps.tolist(), "rows": data.num_rows,
        "record_ms_median": statistics.median(record_s) * 1e3, "load_s": load_s, "methods": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
