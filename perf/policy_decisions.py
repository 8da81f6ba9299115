"""Why a policy misses: the adaptive gate's decisions in the lab, and a demo's step phases per policy.

`lab`: replays the shipped trace through `adaptive` on one cost model and batch size (`dspark.lab.replay.Lab`)
with a spy on the gate (`SpeculationGate.decide`): per full-batch decision the depth chosen, the predicted
speculative and plain tok/s (believed costs) and the gate's rate of every depth (`Adaptive.depth_rates`); the
adaptive run's partial probes (full-batch steps where only some requests drafted: their count, median seconds
and drafter catch-up tokens beside a full-batch plain step's median seconds; a folded prompt's rows included); then
fixed-0 / fixed-1 / fixed-2 / fixed-3 / adaptive over the same queue (run tok/s: useful tokens over the run's
seconds, as `policy_lab.py`'s `run_tok_s`), and adaptive with its depth choice off at each depth 1..gamma (the gate
and that depth's planner): what the depth choice gains or loses against the best single depth, and per depth the
accepted / verified drafts per request the gate believed beside what the run at that depth did (printed where that
run has at least 10 full-batch steps every request drafted in). `--cost` takes a serving cost's name or a JSON file
(a demo's `serving_cost.json`).
`demo`: a `dspark demo` output's demo.json: per (policy, B) the medians over full-batch steps (every round) of
the draft, plan and verify seconds and the verify rows, the drafts verified per step, and the rows' tiers; the
full-batch speculative steps no prompt rode grouped by their verify rows and, where the demo recorded it
(`StepRecord.drafted`), their draft depth (steps, tokens per step, draft + plan + verify ms per step, tok/s over
those phases) and the drain-tail steps per round (fewer than B requests, no prompt riding); per round
the tok/s of all its steps beside the steady window's (its steps, tokens, tok/s and the share of its seconds spent in
steps a refill's prompt rode).

    PYTHONPATH=. python perf/policy_decisions.py lab --cost cpu-measured --batch 64 [--out PATH]
    PYTHONPATH=. python perf/policy_decisions.py demo [--demo-json demo_out/demo.json] [--out PATH]
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

from dspark.util.fileio import atomic_write_text
from dspark.util.options import at_least, output_path


def lab(cost_name: str, b: int) -> dict:
    """The gate's decisions at B = b on `cost_name` (a serving cost's name or JSON file), the fixed / adaptive run
    tok/s beside them, and per depth k adaptive with its depth choice off at k: its run tok/s, the accepted and
    verified drafts per request the gate believed of depth k (median over its decisions) and what the run at k did
    (mean over its full-batch speculative steps in which every request drafted)."""
    from dspark.cost.serving import load_serving_cost
    from dspark.lab.replay.lab import Lab
    from dspark.lab.replay.report import run_tok_s
    from dspark.lab.replay.trace import load_trace
    from dspark.lab.replay.variants import fit_trace_temperatures
    from dspark.serve.policies import Adaptive

    trace = load_trace()
    temps, _ = fit_trace_temperatures(trace, 3)
    study = Lab(trace, load_serving_cost(cost_name, width=4), 3, temperatures=temps)
    policy = study.policy("adaptive", b)
    gate, decisions = policy.gate, []
    decide = gate.decide

    def spy(n: int, depth: int, rate: float, plain_seconds: float) -> None:
        decide(n, depth, rate, plain_seconds)
        if n != b:
            return
        by_depth, believed = {}, {}
        if policy.feedback.mean is not None:
            by_depth = policy.depth_rates(n)
            believed = {k: policy.feedback.predict(k) for k in by_depth}
        decisions.append({"speculate": gate.decided[1], "depth": depth, "speculative_tok_s": rate,
                          "plain_tok_s": n / plain_seconds, "realised_tok_s_by_depth": by_depth,
                          "believed_by_depth": believed})

    gate.decide = spy
    runs, probes = {}, {}
    for name in ("fixed-0", "fixed-1", "fixed-2", "fixed-3", "adaptive"):
        res = study.run(policy if name == "adaptive" else name, b)
        runs[name] = run_tok_s(res)
        if name == "adaptive":
            probes = _probes(res.steps, b)
    finite = [d for d in decisions if d["speculative_tok_s"] != float("inf")]
    # the depth choice off: the gate and one depth's planner (depth gamma: the variant "fixed depth")
    depths = {}
    for k in range(1, study.gamma + 1):
        one = Adaptive(study.planner(b, depth=k), study.cost.believed_plain(study.context), study.gate)
        res = study.run(one, b)
        runs[f"adaptive depth {k}"] = run_tok_s(res)
        full = [s for s in res.steps if s.requests.numel() == b and s.speculated and s.drafting == b]
        believed = [d["believed_by_depth"][k] for d in finite]
        depths[k] = {  # per request per step: what the gate believed of depth k, what depth k's own steps did
            "believed": [statistics.median(x[i] for x in believed) for i in (0, 1)] if believed else None,
            "own_steps": len(full),
            "own": [sum(float((x - 1).sum()) for x in xs) / (b * len(full)) if full else None
                    for xs in ([s.commit_lens for s in full], [s.caps for s in full])]}
    return {"cost": cost_name, "batch": b, "decisions": len(decisions),
            "plain_decisions": sum(not d["speculate"] for d in decisions),
            "depths_when_speculating": dict(collections.Counter(d["depth"] for d in decisions if d["speculate"])),
            "median_speculative_tok_s": statistics.median(d["speculative_tok_s"] for d in finite) if finite else None,
            "plain_tok_s": decisions[0]["plain_tok_s"] if decisions else None,
            "last": decisions[-1] if decisions else None, "partial_probes": probes, "run_tok_s": runs,
            "depths": depths}


def _probes(steps: list, b: int) -> dict:
    """The partial probes among a run's full-batch steps against its full-batch plain steps: each step's draft,
    plan, verify and accept seconds (a folded prompt's rows included, a prefill forward of its own left out)."""
    def own(s) -> float:
        return s.times.draft + s.times.plan + s.times.verify + s.times.accept

    full = [s for s in steps if s.requests.numel() == b]
    probe = [s for s in full if s.speculated and s.drafting < b]
    plain = [s for s in full if not s.speculated]
    return {"count": len(probe), "ms_median": 1e3 * statistics.median(map(own, probe)) if probe else None,
            "catch_up_median": statistics.median(s.catch_up for s in probe) if probe else None,
            "plain_ms_median": 1e3 * statistics.median(map(own, plain)) if plain else None}


def demo(path: Path) -> dict:
    """Per (policy, B) medians of a demo run's full-batch steps, and per round its steady window (the steps with
    every slot busy, refills riding them included) beside the whole run."""
    steps = json.loads(path.read_text())["steps"]
    out = {}
    for key, rounds in steps.items():
        b = int(key.rsplit("@", 1)[1])
        full = [s for run in rounds for s in run if s["batch"] == b]
        if not full:
            continue
        med = {f: statistics.median(s[f] for s in full) for f in ("t_draft", "t_plan", "t_verify", "rows")}
        out[key] = {"steps": len(full), **med, "proposed_per_step": statistics.median(s["proposed"] for s in full),
                    "rows_seen": dict(collections.Counter(s["rows"] for s in full)), "by_rows": _by_rows(full),
                    "tail_steps": [sum(1 for s in run if s["batch"] < b and not _refill(s)) for run in rounds],
                    "rounds": [_window(run, b) for run in rounds]}
    return out


def _useful(s: dict) -> int:
    return s["committed"] if s.get("useful") is None else s["useful"]


def _by_rows(full: list[dict]) -> dict:
    """Full-batch speculative steps no prompt rode, by verify rows (and draft depth k where the demo recorded it:
    key "ROWS rows, k=K"): steps, tokens per step, draft + plan + verify milliseconds per step."""
    groups: dict[tuple[int, int], list[dict]] = collections.defaultdict(list)
    for s in full:
        if s["speculated"] and not _refill(s):
            groups[(s["rows"], s.get("drafted") or 0)].append(s)
    return {(rows if not k else f"{rows} rows, k={k}"): {
                "steps": len(g), "tokens_per_step": sum(map(_useful, g)) / len(g),
                "ms_per_step": 1e3 * sum(s["t_draft"] + s["t_plan"] + s["t_verify"] for s in g) / len(g)}
            for (rows, k), g in sorted(groups.items())}


def _seconds(s: dict) -> float:
    return s["t_draft"] + s["t_plan"] + s["t_verify"] + s["t_accept"] + s.get("t_prefill", 0.0)


def _window(run: list[dict], b: int) -> dict:
    """One round's steps: all of them (steps, committed tokens, seconds; the first admission's prefill is not a
    step's) and the steady window's, with the window's seconds in refill steps: a prompt rode the step, or was
    prefilled right before it (None: a demo.json without `busy_slots`)."""
    useful = [_useful(s) for s in run]
    whole = {"steps": len(run), "tokens": sum(useful), "seconds": sum(map(_seconds, run))}
    if any(s.get("busy_slots") is None for s in run):
        return {"whole": whole, "window": None}
    busy = [(s, u) for s, u in zip(run, useful) if s["busy_slots"] == b]
    return {"whole": whole, "window": {"steps": len(busy), "tokens": sum(u for _, u in busy),
                                       "seconds": sum(_seconds(s) for s, _ in busy),
                                       "refill_step_seconds": sum(_seconds(s) for s, _ in busy if _refill(s)),
                                       "refill_steps": sum(1 for s, _ in busy if _refill(s))}}


def _refill(s: dict) -> bool:
    return bool(s.get("folded_prefill")) or s.get("t_prefill", 0.0) > 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["lab", "demo"])
    ap.add_argument("--cost", default="cpu-measured", help="lab: a serving cost model's name or JSON file")
    ap.add_argument("--batch", type=at_least(1), default=64, help="lab: the batch size B")
    ap.add_argument("--demo-json", type=Path, default=Path("demo_out/demo.json"), help="demo: a demo's demo.json")
    ap.add_argument("--out", type=output_path(), default=None)
    args = ap.parse_args(argv)
    if args.what == "lab":
        report = lab(args.cost, args.batch)
        print(f"{args.cost} B={args.batch}: {report['plain_decisions']} of {report['decisions']} full-batch "
              f"decisions plain; depths when speculating {report['depths_when_speculating']}")
        print(f"  median predicted speculative {report['median_speculative_tok_s']:.1f} tok/s against plain "
              f"{report['plain_tok_s']:.1f} (believed costs); at the last decision: "
              + ", ".join(f"depth {k} {v:.1f}" for k, v in report["last"]["realised_tok_s_by_depth"].items()))
        pr = report["partial_probes"]
        if pr["count"]:
            print(f"  {pr['count']} partial probes: median {pr['ms_median']:.2f} ms, catch-up "
                  f"{pr['catch_up_median']:.0f} tokens; a plain step {pr['plain_ms_median']:.2f} ms")
        runs = report["run_tok_s"]
        best = max((v, k) for k, v in runs.items() if k.startswith("fixed-"))
        depth = max((v, k) for k, v in runs.items() if k.startswith("adaptive depth"))
        for k, d in report["depths"].items():
            if d["believed"] is not None and d["own_steps"] >= 10:
                print(f"  depth {k}: accepted / verified drafts per request per full-batch step, believed (median "
                      f"over decisions) {d['believed'][0]:.3f} / {d['believed'][1]:.3f}, its own run's "
                      f"{d['own'][0]:.3f} / {d['own'][1]:.3f} ({d['own_steps']} steps)")
        print("  run tok/s: " + ", ".join(f"{k} {v:.2f}" for k, v in runs.items())
              + f"; adaptive / best fixed ({best[1]}) {runs['adaptive'] / best[0]:.3f}, / its best single depth "
              f"({depth[1]}) {runs['adaptive'] / depth[0]:.4f}")
    else:
        if not args.demo_json.is_file():
            print(f"{args.demo_json} is not a file: give a `dspark demo` output's demo.json", file=sys.stderr)
            return 2
        report = demo(args.demo_json)
        print(f"{'policy@B':>16} {'steps':>5} {'draft ms':>8} {'plan ms':>7} {'verify ms':>9} {'rows':>5} "
              f"{'drafts':>6}  rows seen")
        for key, r in report.items():
            print(f"{key:>16} {r['steps']:>5} {1e3 * r['t_draft']:>8.1f} {1e3 * r['t_plan']:>7.2f} "
                  f"{1e3 * r['t_verify']:>9.1f} {r['rows']:>5.0f} {r['proposed_per_step']:>6.0f}  {r['rows_seen']}")
        print("full-batch speculative steps no prompt rode, by verify rows (steps, tokens / step, draft + plan + "
              "verify ms / step, tok/s); drain-tail steps per round")
        for key, r in report.items():
            groups = "; ".join(f"{rows}: {g['steps']} {g['tokens_per_step']:.2f} {g['ms_per_step']:.1f} "
                               f"{1e3 * g['tokens_per_step'] / g['ms_per_step']:.1f}"
                               for rows, g in r["by_rows"].items())
            print(f"{key:>16}  {groups or '-'} | tail {r['tail_steps']}")
        print("per round: all steps, the first admission's prefill left out (steps, tok/s) | steady window (steps, "
              "tokens, tok/s, share of its seconds in refill steps)")
        for key, r in report.items():
            cells = []
            for w in r["rounds"]:
                whole, win = w["whole"], w["window"]
                cell = f"{whole['steps']} {whole['tokens'] / whole['seconds']:.1f}"
                if win is not None and win["seconds"] > 0:
                    cell += (f" | {win['steps']} {win['tokens']} {win['tokens'] / win['seconds']:.1f} "
                             f"{100 * win['refill_step_seconds'] / win['seconds']:.0f}%")
                cells.append(cell)
            print(f"{key:>16}  " + "; ".join(cells))
    if args.out is not None:
        print(f"wrote {atomic_write_text(args.out, json.dumps(report, indent=2))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
