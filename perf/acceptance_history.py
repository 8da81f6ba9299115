"""Can a request's history tell, before it drafts, that this step's drafts will be rejected? Per-request
speculation's ceiling from what a request knows before it drafts.

The per-request break-even rule (a request whose expected accepted drafts are below break-even decodes plain this
step; issue 44, Build 5) can only decide from what a request knows before its draft runs: its previous step's
outcome and the target's logits that chose its root. This script walks every request of the shipped trace along
the fixed-gamma greedy path (the steps a decode loop takes, `step_rows`) and, per step after a request's first,
groups the accepted drafts a(t) by those predictors:

- `prev accepted`: the drafts the request's previous step accepted (0..gamma);
- `prev survival`: the previous step's calibrated survival (STS, the lab's fit) at its first rejected draft (its
  last draft when all were accepted), by quintile: how sure the head was where it failed;
- `root margin`: the target's top-1 minus top-2 logit at the root token (it chose the root), by quintile;
- `prev 0 x root margin`: the steps after a step that accepted nothing, by root-margin quintile.

Per shipped serving cost and B it prices one request's speculation at the margin (`ServingCost.price`, every
request at the trace's mean context, no catch-up): `marginal_seconds`, what a batch of B speculating requests
saves when one of them verifies its root only and drafts nothing (at B = 1: T_spec - T_plain). A step sent plain
loses its a(t) drafts and saves those seconds. Columns: a*, the marginal seconds at the all-speculating batch's
tokens / s (the accepted drafts that pay for one request's speculation); `best rule`, over every predictor and
every threshold on its bucket means (the lowest buckets plain), the best gain over always speculating, picked
with hindsight on the same steps: an upper bound for a rule on these predictors; `per-step oracle`, the best
threshold on a(t) itself (the rule told each step's outcome). Per-step accounting on the fixed-gamma path
(tokens 1 + a(t) or 1, seconds less the marginal price per plain step), exact at B = 1 and approximate where
many requests of a batch go plain; not a replay (the lab's "per-request oracle" variant is that replay).

    PYTHONPATH=. python perf/acceptance_history.py [--gamma 3] [--batch-sizes 1,16] \
        [--out perf/results/acceptance_history.json]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from labelled import save_labelled  # perf/labelled.py: a script's own folder is first on sys.path

from dspark.cost.serving import StepWork, load_serving_cost, serving_cost_names
from dspark.lab.replay.lab import mean_context
from dspark.lab.replay.trace import load_trace
from dspark.lab.replay.variants import fit_trace_temperatures, step_rows
from dspark.plan.survival import survival_host
from dspark.util.options import at_least, int_list, output_path

QUINTILES = 5


def history(trace, gamma: int, temperatures: list[float]) -> dict[str, np.ndarray]:
    """Per step after a request's first on the fixed-gamma path: a(t) and the predictors known before it drafts."""
    rows = step_rows(trace, gamma, torch.arange(trace.num_requests)).numpy()
    offsets = trace.position_offsets.numpy()
    request = np.searchsorted(offsets, rows, side="right") - 1
    accepted = np.minimum(trace.accepted.numpy()[rows], gamma)
    survival = survival_host(trace.confidence_logits.numpy()[rows, :gamma].astype(np.float64),
                             np.asarray(temperatures, dtype=np.float32))
    failed_at = survival[np.arange(rows.size), np.minimum(accepted, gamma - 1)]
    # the root of the step at position t is continuation position t - 1, stored from offsets[i] + i * gamma
    root_margin = trace.target_margin.numpy()[rows - 1 + request * gamma]
    later = np.flatnonzero(rows[1:] > rows[:-1]) + 1  # a step with an earlier step of the same request
    later = later[request[later] == request[later - 1]]
    return {"accepted": accepted[later].astype(np.float64), "prev_accepted": accepted[later - 1],
            "prev_survival": failed_at[later - 1].astype(np.float64),
            "root_margin": root_margin[later].astype(np.float64)}


def quintile(x: np.ndarray) -> np.ndarray:
    edges = np.quantile(x, np.linspace(0, 1, QUINTILES + 1)[1:-1])
    return np.searchsorted(edges, x, side="right")


def buckets(h: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, list[str]]]:
    """predictor -> (bucket id per step, bucket names)."""
    prev0 = h["prev_accepted"] == 0
    margin_q = quintile(h["root_margin"])
    gamma = int(h["prev_accepted"].max())
    names_q = [f"q{i + 1}" for i in range(QUINTILES)]
    return {"prev accepted": (h["prev_accepted"], [str(a) for a in range(gamma + 1)]),
            "prev survival": (quintile(h["prev_survival"]), names_q),
            "root margin": (margin_q, names_q),
            "prev 0 x root margin": (np.where(prev0, margin_q, QUINTILES), names_q + ["prev > 0"])}


def break_even(cost, b: int, gamma: int, context: float, mean_accepted: float) -> dict:
    """One request's speculation at the margin in a batch of b speculating requests: its seconds and the accepted
    drafts that pay them at the batch's rate."""
    kv = round(context * b)
    spec = cost.price(StepWork(b, b * (gamma + 1), kv, drafts=gamma, drafting=b))
    less = (cost.price(StepWork(b, b * (gamma + 1) - gamma, kv, drafts=gamma, drafting=b - 1)) if b > 1
            else cost.price(StepWork(1, 1, kv)))
    rate = b * (1 + mean_accepted) / spec  # tokens per second of the all-speculating batch
    return {"spec_seconds": spec, "marginal_seconds": spec - less, "a_star": (spec - less) * rate}


def rule_gain(accepted: np.ndarray, plain: np.ndarray, be: dict, b: int) -> float:
    """Tokens / s of going plain on the steps `plain`, over always speculating (per-step marginal accounting)."""
    per_request = be["spec_seconds"] / b  # each step's share of the batch's step
    spec_rate = (1 + accepted).sum() / (per_request * accepted.size)
    tokens = np.where(plain, 1.0, 1 + accepted).sum()
    seconds = per_request * accepted.size - be["marginal_seconds"] * plain.sum()
    return float(tokens / seconds / spec_rate)


def best_threshold(accepted: np.ndarray, score: np.ndarray, be: dict, b: int) -> tuple[float, int]:
    """(the best `rule_gain` of going plain on the steps whose score is below a threshold, over every threshold
    (none: 1.0), the steps it sends plain)."""
    best = (1.0, 0)
    for t in np.unique(score)[1:]:
        plain = score < t
        gain = rule_gain(accepted, plain, be, b)
        if gain > best[0]:  # ties keep the fewer plain steps
            best = (gain, int(plain.sum()))
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gamma", type=at_least(1), default=3)
    ap.add_argument("--batch-sizes", type=int_list(1), default=(1, 16))
    ap.add_argument("--label", default="current")
    ap.add_argument("--out", type=output_path(), default="perf/results/acceptance_history.json")
    args = ap.parse_args(argv)
    t0, gamma = time.perf_counter(), args.gamma
    trace = load_trace()
    temps, _ = fit_trace_temperatures(trace, gamma)
    h = history(trace, gamma, temps)
    accepted, context = h["accepted"], mean_context(trace)
    groups = buckets(h)
    table = {}
    print(f"{accepted.size} steps after a request's first (fixed-{gamma} path), mean a(t) {accepted.mean():.3f}, "
          f"P(a = 0) {(accepted == 0).mean():.3f}")
    for name, (ids, labels) in groups.items():
        rows = [{"bucket": label, "steps": int((ids == i).sum()), "mean_accepted": float(accepted[ids == i].mean()),
                 "p_zero": float((accepted[ids == i] == 0).mean())} for i, label in enumerate(labels)]
        table[name] = rows
        print(f"  {name:>22}: " + "  ".join(f"{r['bucket']} {r['mean_accepted']:.2f} ({r['steps']})" for r in rows))
    means = {name: np.array([accepted[ids == i].mean() for i in range(len(labels))])
             for name, (ids, labels) in groups.items()}
    low = min(means, key=lambda n: means[n].min())
    print(f"lowest bucket: {low} {groups[low][1][int(means[low].argmin())]}, mean a(t) {means[low].min():.3f}")
    verdicts = {}
    print(f"\n{'cost model':>22} {'B':>4} {'a*':>6} {'best rule':>10} {'plain steps':>11} {'predictor':>22} "
          f"{'per-step oracle':>16} {'plain steps':>11}")
    for cost_name in serving_cost_names():
        cost = load_serving_cost(cost_name, width=gamma + 1)
        for b in args.batch_sizes:
            be = break_even(cost, b, gamma, context, float(accepted.mean()))
            rules = {name: best_threshold(accepted, means[name][ids], be, b) for name, (ids, _) in groups.items()}
            name = max(rules, key=lambda n: rules[n])
            oracle = best_threshold(accepted, accepted, be, b)
            verdicts[f"{cost_name}@{b}"] = {**be, "rules": rules, "per_step_oracle": oracle}
            print(f"{cost_name:>22} {b:>4} {be['a_star']:>6.3f} {rules[name][0]:>10.4f} {rules[name][1]:>11} "
                  f"{name if rules[name][1] else '-':>22} {oracle[0]:>16.4f} {oracle[1]:>11}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return save_labelled(args.out, args.label, {
        "gamma": gamma, "temperatures": temps, "context": context, "steps": int(accepted.size),
        "mean_accepted": float(accepted.mean()), "buckets": table, "verdicts": verdicts})


if __name__ == "__main__":
    main()
