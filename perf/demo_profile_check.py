"""How well a `make demo` profile priced the demo's own live steps: per B and fixed-k policy, the median live step
against the serving cost the planners believed, and each policy's live and believed tokens per second.

Reads a demo output folder (demo.json and serving_cost.json, written by `python -m dspark.cli demo`). Only the steps
with every slot busy and no prefill are compared: the rows a fixed-k step verifies are then B x (k + 1), the point
the profile priced. A ratio that differs between two depths is a profile error the adaptive policy's depth choice
inherits (the machine's drift between the profile and the rounds moves every depth alike).

    PYTHONPATH=. python perf/demo_profile_check.py [--demo demo_out] [--out perf/results/demo_profile_check.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from dspark.cost.serving import load_serving_cost
from dspark.util.fileio import atomic_write_text
from dspark.util.options import output_path

PHASES = ("t_draft", "t_plan", "t_verify", "t_accept")


def check(demo: Path) -> list[dict]:
    """One row per (B, fixed-k) of the demo: live and believed median step seconds and tokens per second."""
    for name in ("demo.json", "serving_cost.json"):
        if not (demo / name).is_file():
            raise SystemExit(f"{demo / name} is missing: pass --demo the output folder of a tiered `make demo`")
    steps = json.loads((demo / "demo.json").read_text())["steps"]
    cost = load_serving_cost(demo / "serving_cost.json")
    rows = []
    for key, rounds in steps.items():
        policy, b = key.rsplit("@", 1)
        if not policy.startswith("fixed-"):
            continue
        b, k = int(b), int(policy[len("fixed-"):])
        full = [s for r in rounds for s in r if len(s["verify_lens"]) == b and s["t_prefill"] == 0]
        if not full:
            continue
        live = statistics.median(sum(s[p] for p in PHASES) for s in full)
        believed = cost.plain_seconds(b) if k == 0 else float(cost.believed(k, 0.0).step_seconds(b, b * (k + 1)))
        tokens = statistics.fmean(s["committed"] for s in full)
        rows.append({"B": b, "policy": policy, "steps": len(full), "live_ms": live * 1e3, "believed_ms": believed * 1e3,
                     "ratio": live / believed, "tokens_per_step": tokens, "live_tok_s": tokens / live,
                     "believed_tok_s": tokens / believed})
    return sorted(rows, key=lambda r: (r["B"], r["policy"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", type=Path, default=Path("demo_out"), help="a demo's output folder (default demo_out)")
    ap.add_argument("--out", type=output_path(), default="perf/results/demo_profile_check.json")
    args = ap.parse_args(argv)
    out, rows = args.out, check(args.demo)
    print(f"{'B':>3} {'policy':<8} {'steps':>5} {'live ms':>8} {'believed':>8} {'ratio':>6} {'tok/step':>8} "
          f"{'live tok/s':>10} {'believed':>8}")
    for r in rows:
        print(f"{r['B']:>3} {r['policy']:<8} {r['steps']:>5} {r['live_ms']:>8.1f} {r['believed_ms']:>8.1f} "
              f"{r['ratio']:>6.2f} {r['tokens_per_step']:>8.2f} {r['live_tok_s']:>10.1f} {r['believed_tok_s']:>8.1f}")
    atomic_write_text(out, json.dumps({"benchmark": "demo_profile_check", "demo": str(args.demo), "rows": rows},
                                      indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
