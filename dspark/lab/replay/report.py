"""What a policy-lab study reports per (cost model, B, policy), its table and its plot.

`run_summary` reads one replayed run: throughput at a fixed concurrency over the measured requests of the queue
in simulated seconds (B x their tokens / their summed latency: Little's law for B requests always in flight,
prefill included), time per output token per request (p50 / p90), the two numbers vLLM's and SGLang's serving
benchmarks report, rows and drafts per step, the share of
speculative steps, the tau bias (committed vs the calibrated prediction), and the planner's measured wall time
per decision beside the modelled step time. `ratios` puts every budget policy against the best fixed policy
(plain decoding included) and the oracle at the same B.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from dspark.config import ScheduleConfig
from dspark.plan.budget import expected_commit
from dspark.plan.survival import calibrated_survival
from dspark.serve.outcome import GenerateResult
from dspark.util.validate import check_type

BUDGET_POLICIES = ("adaptive", "adaptive-est")


def per_request(res: GenerateResult) -> dict[int, tuple[int, float, float, bool]]:
    """Per queued request: (counted tokens, latency seconds, time to its first decode step, ran at full
    concurrency). Latency: the seconds of every step it decoded in, its admission's prefill included (later
    admissions' prefill too: they stall it), or the step its prompt rode (`StepOutcome.folded_owners`); steps
    run one after another, so this is its wall time in flight. A step runs at full concurrency when every slot
    holds a request (decoding, or its prompt riding the step)."""
    out: dict[int, list] = {}
    for i, s in enumerate(res.steps):
        prefill = res.startup_seconds if i == 0 else s.times.prefill
        folded = [] if s.folded_owners is None else s.folded_owners.tolist()
        full = s.busy_slots == res.max_batch
        for owner in folded:
            out[owner] = [0, s.times.total, s.times.total, full]
        for owner, n in zip(s.owners.tolist(), s.useful_per_request.tolist()):
            if owner not in out:
                out[owner] = [0, 0.0, prefill, True]
            row = out[owner]
            row[0] += n
            row[1] += s.times.total + (prefill if i == 0 else 0.0)
            row[3] = row[3] and full
    return {r: tuple(v) for r, v in out.items()}


def _counted(reqs: dict[int, tuple], measured: range | None) -> list[tuple]:
    """`per_request`'s rows of the queue positions `measured` (None: all); ValueError unless they are a non-empty
    range of the run's positions."""
    if measured is None:
        return [reqs[r] for r in sorted(reqs)]
    if not (len(check_type("measured", measured, range)) and min(measured) in reqs and max(measured) in reqs):
        raise ValueError(f"measured must be a non-empty range of the run's queue positions 0..{len(reqs) - 1}, "
                         f"got {measured!r}")
    return [reqs[r] for r in measured]


def time_per_output_token(res: GenerateResult, measured: range | None = None) -> list[float]:
    """Seconds per output token of each counted request that produced one: (latency - time to its first decode
    step) / tokens (`per_request`); measured: the queue positions counted (None: every request)."""
    reqs = per_request(res)
    counted = _counted(reqs, measured)
    return [(c[1] - c[2]) / c[0] for c in counted if c[0]]


def run_tok_s(res: GenerateResult) -> float:
    """A run's useful tokens (none past a request's end) over all its seconds, prefill, ramp and drain included."""
    return sum(s.useful for s in res.steps) / res.seconds if res.seconds > 0 else 0.0


def run_summary(res: GenerateResult, temperatures: Sequence[float] | None, measured: range | None = None) -> dict:
    """One run's numbers; temperatures [k]: how the step's confidence logits turn into the predicted tau
    (None: raw, e.g. the online estimator's own calibration); measured: the queue positions counted (None:
    every request).

    tok_s: B x (their tokens) / (their summed latency), Little's law for B requests always in flight (equal to
    tokens over seconds when every counted request ran at full concurrency, `full_concurrency`); tpot_ms_p50 /
    p90: per request, (latency - time to its first decode step) / tokens; prefill_forwards: the run's prefill
    forwards (admissions of at least one prompt token to prefill in a forward of their own); prefills_folded:
    the steps whose forward prefilled admitted prompts."""
    reqs = per_request(res)
    counted = _counted(reqs, measured)
    tokens = sum(c[0] for c in counted)
    latency = sum(c[1] for c in counted)
    tpot = time_per_output_token(res, measured)
    spec = [s for s in res.steps if s.speculated]
    deepest = max((s.confidence_logits.shape[1] for s in spec), default=0)
    if temperatures is not None and len(temperatures) < deepest:
        raise ValueError(f"temperatures must hold {deepest} values (one per draft position), got {list(temperatures)}")
    predicted = committed = 0.0
    for s in spec:
        k = s.confidence_logits.shape[1]
        temps = None if temperatures is None else torch.as_tensor(list(temperatures)[:k])
        survival = calibrated_survival(s.confidence_logits, temps)
        predicted += float(expected_commit(survival, s.caps.to(torch.int64), ScheduleConfig(gamma=k)))
        committed += float(s.commit_lens.sum())
    plan_us = [s.times.host_plan * 1e6 for s in spec]
    return {
        "tok_s": res.max_batch * tokens / latency if latency > 0 else 0.0,
        "tokens": tokens,
        "requests": len(counted),
        "full_concurrency": all(c[3] for c in counted),
        "tpot_ms_p50": 1e3 * float(np.percentile(tpot, 50)),
        "tpot_ms_p90": 1e3 * float(np.percentile(tpot, 90)),
        "run_tok_s": run_tok_s(res),
        "steps": len(res.steps),
        "seconds": res.seconds,
        "prefill_share": (res.startup_seconds + sum(s.times.prefill for s in res.steps)) / res.seconds,
        "prefill_forwards": sum(1 for s in res.steps if s.prefill_tokens > 0 and not s.prefill_folded),
        "prefills_folded": sum(1 for s in res.steps if s.prefill_folded),
        "rows_per_step": statistics.fmean(float(s.layout.total_rows) for s in res.steps),
        "drafts_per_step": statistics.fmean(float(s.confidence_logits.shape[1]) for s in res.steps),
        "speculative_share": len(spec) / len(res.steps),
        "committed_per_request_step": statistics.fmean(float(s.commit_lens.double().mean()) for s in res.steps),
        "tau_bias": committed / predicted - 1.0 if predicted else None,
        "planner_us_median": statistics.median(plan_us) if plan_us else None,
        "step_ms_mean": statistics.fmean((s.times.draft + s.times.verify) * 1e3 for s in spec) if spec else None,
    }


def ratios(cells: Mapping[str, dict]) -> dict:
    """At one B, `cells` policy -> run_summary: the best fixed policy (`fixed-0`, plain decoding, included) and
    each budget policy's throughput over it and over the oracle."""
    fixed = {name: c["tok_s"] for name, c in cells.items() if name.startswith("fixed-")}
    if not fixed:
        raise ValueError(f"cells must hold at least one fixed-k policy's run_summary, got {sorted(cells)}")
    best = max(fixed, key=fixed.__getitem__)
    out: dict = {"best_fixed": best, "best_fixed_tok_s": fixed[best]}
    for name in cells:
        if name in BUDGET_POLICIES or not (name.startswith("fixed-") or name == "oracle"):
            tok = cells[name]["tok_s"]
            out[name] = {"vs_best_fixed": tok / fixed[best], "vs_plain": tok / fixed["fixed-0"] if "fixed-0" in fixed
                         else None, "vs_oracle": tok / cells["oracle"]["tok_s"] if "oracle" in cells else None}
    return out


def format_table(cost: str, rows: Mapping[int, Mapping[str, dict]], policies: Sequence[str]) -> str:
    """A text table: per B, tok/s at fixed concurrency of every policy, the best fixed k, adaptive / best fixed and
    / oracle."""
    budget = [p for p in policies if not p.startswith("fixed-") and p != "oracle"]
    head = ["B"] + list(policies) + ["best fixed"] + [f"{p}/fixed" for p in budget] + [f"{p}/oracle" for p in budget]
    lines = [f"cost model: {cost} (simulated tok/s at fixed concurrency)", "  ".join(f"{h:>12}" for h in head)]
    for b, cells in rows.items():
        r = ratios(cells)
        vals = [f"{b:>12}"] + [f"{cells[p]['tok_s']:>12.1f}" for p in policies] + [f"{r['best_fixed']:>12}"]
        vals += [f"{r[p]['vs_best_fixed']:>12.3f}" for p in budget]
        vals += [f"{r[p]['vs_oracle']:>12.3f}" if r[p]["vs_oracle"] else f"{'-':>12}" for p in budget]
        lines.append("  ".join(vals))
    return "\n".join(lines)


def plot_throughput(cost: str, rows: Mapping[int, Mapping[str, dict]], policies: Sequence[str], path: Path) -> bool:
    """Throughput vs B (log2), one line per policy, to `path` (PNG); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    bs = sorted(rows)
    fig, (ax, rel) = plt.subplots(1, 2, figsize=(12, 4.5))
    for p in policies:
        style = "-" if not p.startswith("fixed-") else ":"
        ax.plot(bs, [rows[b][p]["tok_s"] for b in bs], style, marker="o", ms=3, label=p)
        best = [rows[b][ratios(rows[b])["best_fixed"]]["tok_s"] for b in bs]
        rel.plot(bs, [rows[b][p]["tok_s"] / f for b, f in zip(bs, best)], style, marker="o", ms=3, label=p)
    for a, title in ((ax, "tokens / s at fixed concurrency (simulated)"), (rel, "relative to the best fixed policy at each B")):
        a.set_xscale("log", base=2)
        a.set_xlabel("B (requests decoding at once)")
        a.set_title(title)
        a.grid(alpha=0.3)
    ax.set_yscale("log")
    rel.axhline(1.0, color="k", lw=0.8)
    rel.legend(fontsize=7, ncol=2)
    fig.suptitle(f"policy lab: {cost}")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return True
