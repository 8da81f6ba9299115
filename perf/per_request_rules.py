"""The per-request rules of issue 44's Build 5, bounded on the trace before building them: can a request tell,
before it drafts, that its drafts will be rejected (per-request speculation)? Can it tell, while a chain drafts,
that the next draft is not worth its forward (early exit)?

Every request of the shipped trace is walked along the fixed-gamma greedy path (the steps a decode loop takes,
`step_rows`), each step's accepted drafts a(t) next to what the request knew and when:

1. Before drafting (per-request speculation: a request below break-even decodes plain this step). Per step after
   a request's first, a(t) grouped by `prev accepted` (the drafts its previous step accepted, 0..gamma), `prev
   survival` (that step's calibrated survival, the lab's STS fit, at its first rejected draft or its last, by
   quintile: how sure the head was where it failed), `root margin` (the target's top-1 minus top-2 logit at the
   root token, which it chose; quintiles) and `prev 0 x root margin` (after a step that accepted nothing, by
   root-margin quintile). Priced at the margin (`ServingCost.price`, every request at the trace's mean context,
   no catch-up): `marginal_seconds`, what a batch of B speculating requests saves when one of them verifies its
   root only and drafts nothing (at B = 1: T_spec - T_plain); a step sent plain loses its a(t) drafts. a* is the
   marginal seconds at the all-speculating batch's tokens / s. `best rule`: over every predictor and every
   threshold on its bucket means (the lowest buckets plain), the best gain over always speculating, picked with
   hindsight on the same steps (an upper bound for a rule on these predictors); `per-step oracle`: the best
   threshold on a(t) itself. At B > 1 each plain request is priced at the margin of a batch that speculates
   (approximate where many go plain).
2. While drafting (early exit, B = 1: a chain drafter stops after the first draft j < gamma whose survival
   through j, the calibrated product c_1 ... c_j, is at or below a threshold; the drafts it made are verified).
   Each step priced at the depth d it drafted (`ServingCost.price`: d drafts, d + 1 rows) and committing
   1 + min(a(t), d). `early exit`: the best threshold over every survival value, with hindsight, against the best
   fixed depth; `depth oracle`: every step drafting max(a(t), 1).

The marginal price of one step is exact at B = 1, but the accounting keeps the fixed-gamma path throughout: a
step sent plain or drafting less would move the later steps of a replay (the lab's "per-request oracle" variant
is that replay for rule 1). The gains are tok/s ratios over always speculating at gamma (rule 1) and over the
best fixed depth (rule 2), on the same steps.

    PYTHONPATH=. python perf/per_request_rules.py [--gamma 3] [--batch-sizes 1,16] [--label current] \
        [--out perf/results/per_request_rules.json]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from labelled import save_labelled  # perf/labelled.py: a script's own folder is first on sys.path

from dspark.cost.serving import ServingCost, StepWork, load_serving_cost, serving_cost_names
from dspark.lab.replay.lab import mean_context
from dspark.lab.replay.trace import Trace, load_trace
from dspark.lab.replay.variants import fit_trace_temperatures, step_rows
from dspark.plan.survival import survival_host
from dspark.util.options import at_least, int_list, output_path

QUINTILES = 5


def path_steps(trace: Trace, gamma: int, temperatures: list[float]) -> dict[str, np.ndarray]:
    """Every step of the fixed-gamma path: its trace row, request, a(t) (capped at gamma) and survival [n, gamma]."""
    rows = step_rows(trace, gamma, torch.arange(trace.num_requests)).numpy()
    survival = survival_host(trace.confidence_logits.numpy()[rows, :gamma].astype(np.float64),
                             np.asarray(temperatures, dtype=np.float32))
    return {"rows": rows, "request": np.searchsorted(trace.position_offsets.numpy(), rows, side="right") - 1,
            "accepted": np.minimum(trace.accepted.numpy()[rows], gamma), "survival": survival.astype(np.float64)}


def history(trace: Trace, steps: dict[str, np.ndarray], gamma: int) -> dict[str, np.ndarray]:
    """Per step after a request's first: a(t) and the predictors known before it drafts."""
    rows, request, accepted, survival = steps["rows"], steps["request"], steps["accepted"], steps["survival"]
    failed_at = survival[np.arange(rows.size), np.minimum(accepted, gamma - 1)]
    # the root of a step at position t is continuation position t - 1 (request i's from `_cont_start[i]`: the
    # trace stores N_i + trace.gamma entries per request, whatever gamma the walk drafts)
    t = rows - trace.position_offsets.numpy()[request]
    root_margin = trace.target_margin.numpy()[trace._cont_start.numpy()[request] + t - 1]
    later = np.flatnonzero(request[1:] == request[:-1]) + 1  # a step with an earlier step of the same request
    return {"accepted": accepted[later].astype(np.float64), "prev_accepted": accepted[later - 1],
            "prev_survival": failed_at[later - 1], "root_margin": root_margin[later].astype(np.float64)}


def quintile(x: np.ndarray) -> np.ndarray:
    edges = np.quantile(x, np.linspace(0, 1, QUINTILES + 1)[1:-1])
    return np.searchsorted(edges, x, side="right")


def buckets(h: dict[str, np.ndarray], gamma: int) -> dict[str, tuple[np.ndarray, list[str]]]:
    """predictor -> (bucket id per step, bucket names)."""
    margin_q = quintile(h["root_margin"])
    names_q = [f"q{i + 1}" for i in range(QUINTILES)]
    return {"prev accepted": (h["prev_accepted"], [str(a) for a in range(gamma + 1)]),
            "prev survival": (quintile(h["prev_survival"]), names_q),
            "root margin": (margin_q, names_q),
            "prev 0 x root margin": (np.where(h["prev_accepted"] == 0, margin_q, QUINTILES), names_q + ["prev > 0"])}


def break_even(cost: ServingCost, b: int, gamma: int, context: float, mean_accepted: float) -> dict:
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


def early_exit(accepted: np.ndarray, survival: np.ndarray, seconds: np.ndarray) -> dict:
    """At B = 1: the best fixed depth, the best early-exit threshold against it (stop after the first draft
    j < gamma whose survival through j is <= the threshold), over every threshold, and the depth oracle (max(a(t), 1)
    drafts). accepted [n], survival [n, gamma] non-increasing along positions, seconds [gamma] per depth."""
    n, gamma = survival.shape

    def tokens(depth: int | np.ndarray) -> np.ndarray:  # per step drafting `depth` (an int, [n] or [1, m])
        a = accepted if np.ndim(depth) < 2 else accepted[:, None]
        return 1 + np.minimum(a, depth)

    fixed = [float(tokens(d).sum() / (n * seconds[d - 1])) for d in range(1, gamma + 1)]
    base, best = max(fixed), (1.0, None, float(np.argmax(fixed) + 1))
    # raising the threshold past s[i, j - 1] moves step i from depth j + 1 to depth j (survival never rises)
    j = np.arange(1, gamma)
    at = survival[:, : gamma - 1].ravel()
    d_tok = (tokens(j[None, :]) - tokens(j[None, :] + 1)).ravel()
    d_sec = np.broadcast_to(seconds[j - 1] - seconds[j], (n, gamma - 1)).ravel()
    order = np.argsort(at, kind="stable")
    at, d_tok, d_sec = at[order], d_tok[order], d_sec[order]
    last = np.append(at[1:] != at[:-1], True)  # a threshold takes every event at its value
    tok = tokens(gamma).sum() + np.cumsum(d_tok)
    sec = n * seconds[gamma - 1] + np.cumsum(d_sec)
    depth_sum = n * gamma - np.cumsum(np.ones_like(at))
    gain = np.where(last, tok / sec / base, -np.inf)
    i = int(np.argmax(gain))
    if gain[i] > best[0]:
        best = (float(gain[i]), float(at[i]), float(depth_sum[i] / n))
    oracle = float(tokens(np.maximum(accepted, 1)).sum() / seconds[np.maximum(accepted, 1) - 1].sum() / base)
    return {"fixed_depth": int(np.argmax(fixed)) + 1, "fixed_rates": fixed, "early_exit": best[0],
            "threshold": best[1], "mean_depth": best[2], "depth_oracle": oracle}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gamma", type=at_least(1), default=3)
    ap.add_argument("--batch-sizes", type=int_list(1), default=(1, 16))
    ap.add_argument("--label", default="current")
    ap.add_argument("--out", type=output_path(), default="perf/results/per_request_rules.json")
    args = ap.parse_args(argv)
    t0, gamma = time.perf_counter(), args.gamma
    trace = load_trace()
    temps, _ = fit_trace_temperatures(trace, gamma)
    steps = path_steps(trace, gamma, temps)
    h = history(trace, steps, gamma)
    accepted, context = h["accepted"], mean_context(trace)
    groups = buckets(h, gamma)
    table = {}
    print(f"1. before drafting: {accepted.size} steps after a request's first (fixed-{gamma} path), mean a(t) "
          f"{accepted.mean():.3f}, P(a = 0) {(accepted == 0).mean():.3f}; mean a(t) per bucket (steps)")
    for name, (ids, labels) in groups.items():
        rows = [{"bucket": label, "steps": int((ids == i).sum()), "mean_accepted": float(accepted[ids == i].mean()),
                 "p_zero": float((accepted[ids == i] == 0).mean())} for i, label in enumerate(labels)]
        table[name] = rows
        print(f"  {name:>22}: " + "  ".join(f"{r['bucket']} {r['mean_accepted']:.2f} ({r['steps']})" for r in rows))
    means = {name: np.array([accepted[ids == i].mean() for i in range(len(labels))])
             for name, (ids, labels) in groups.items()}
    verdicts, exits = {}, {}
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
    kv = round(context)
    print(f"\n2. while drafting, B = 1: {steps['accepted'].size} steps\n{'cost model':>22} {'best fixed depth':>16} "
          f"{'early exit':>10} {'threshold':>9} {'mean depth':>10} {'depth oracle':>12}")
    for cost_name in serving_cost_names():
        cost = load_serving_cost(cost_name, width=gamma + 1)
        seconds = np.array([cost.price(StepWork(1, d + 1, kv, drafts=d, drafting=1)) for d in range(1, gamma + 1)])
        e = exits[cost_name] = early_exit(steps["accepted"], steps["survival"], seconds)
        threshold = "-" if e["threshold"] is None else f"{e['threshold']:.3f}"
        print(f"{cost_name:>22} {e['fixed_depth']:>16} {e['early_exit']:>10.4f} {threshold:>9} "
              f"{e['mean_depth']:>10.2f} {e['depth_oracle']:>12.4f}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return save_labelled(args.out, args.label, {
        "gamma": gamma, "temperatures": temps, "context": context, "steps": int(accepted.size),
        "mean_accepted": float(accepted.mean()), "buckets": table, "verdicts": verdicts, "early_exit": exits})


if __name__ == "__main__":
    main()
