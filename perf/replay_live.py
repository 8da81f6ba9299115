"""Replay vs live: the trace replay's predicted tok/s against the live engine's measured tok/s, cell by cell.

The same queue of trace requests is served live (SmolLM2 + the shipped draft on this CPU, `SpecDecoder`, one
thread, thread clock) and replayed (`dspark.lab.replay.Lab`), every policy built by the same factory with planners
over the same serving cost model: by default one profiled in this run, before the live rounds, by the engine's
own profiler (`dspark.lab.serving_profile.profile_serving_cost`: whole steps per tier, plain steps, the draft phase
per depth, the prefill, the KV term from plain steps on 32- and 160-token prompts), so the table and the runs it is compared with share the machine and the hour. Per
(policy, B): the step-by-step agreement of live and replay (`dspark.lab.replay.live.step_agreement`), the live and
replayed tok/s at fixed concurrency (the lab's measure, `run_summary` over the queue's measured requests;
medians over lockstep rounds), and the residual phase by phase (`priced_phases`: draft, target, prefill, plan).
Each live round also advances, in the same lockstep, a canary: full-batch steps of B requests on the profile's own
prompts, the workload the table was profiled on, at each draft depth in turn (plain, then fixed-1 .. fixed-gamma,
one run of the profile's length each), restarted until it has run about as long as the policies. Its priced /
measured - 1 per depth (`machine_speed`, per B and round) is how far the machine's speed during the round is from
its speed during the profile for steps of that depth's width (B (k + 1) rows): a slow spell need not slow a wide
step as much as a narrow one. `gap_at_round_speed` is the replay's gap with each replayed step's seconds scaled by
the factor at its verify rows (the rounds' medians, linear between the depths' widths; `speed`: the factor over the
whole replay). JSON and a PNG.

    PYTHONPATH=. python perf/replay_live.py [--model real|tiny] [--batch-sizes 1,4,16] [--requests-per-slot 2]
        [--fill-per-slot 1] [--min-requests 8] [--repeats 2] [--cost same-run|NAME|PATH]
        [--out perf/results/replay_live.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Generator

import numpy as np
import torch

from dspark.config import VerifyMode
from dspark.cost.serving import ServingCost, load_serving_cost
from dspark.lab.progress import Progress
from dspark.lab.replay.lab import UNTIMED_PROBE, Lab, ServingQueue, serving_queue
from dspark.lab.replay.live import live_tiers, priced_phases, step_agreement, work_of
from dspark.lab.replay.report import run_summary
from dspark.lab.replay.trace import Trace
from dspark.lab.replay.variants import fit_trace_temperatures
from dspark.lab.timing import lockstep
from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.serve.outcome import GenerateResult, StepOutcome
from dspark.serve.policies import FixedK
from dspark.util.fileio import write_json_atomic
from dspark.util.options import at_least, int_list, output_path

POLICIES = ("fixed-0", "fixed-1", "fixed-2", "fixed-3", "adaptive", "adaptive-est")  # the oracle cannot run live
PHASES = ("draft", "target", "prefill", "plan")
GOAL = 0.05
PROFILE_TOKENS, PROMPT_LEN = 12, 32  # the demo profile's run length and prompt length
LONG_PROMPT_LEN = 160  # the KV term's second context (the trace's requests hold 122 cached tokens on average)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("real", "tiny"), default="real", help="tiny: the tests' models (a smoke run)")
    ap.add_argument("--cost", default="same-run",
                    help="same-run (profiled here, before the live rounds), a shipped serving cost name or a .json path")
    ap.add_argument("--gamma", type=at_least(1), default=3)
    ap.add_argument("--batch-sizes", type=int_list(1), default=(1, 4, 16))
    ap.add_argument("--requests-per-slot", type=at_least(1), default=2, help="measured requests per slot")
    ap.add_argument("--fill-per-slot", type=at_least(0), default=1, help="requests per slot after the measured ones")
    ap.add_argument("--min-requests", type=at_least(1), default=8, help="measured requests at least")
    ap.add_argument("--repeats", type=at_least(1), default=2, help="timed lockstep rounds per B")
    ap.add_argument("--profile-repeats", type=at_least(1), default=2, help="lockstep sweeps per profiled point")
    ap.add_argument("--out", type=output_path(), default="perf/results/replay_live.json")
    return ap.parse_args(argv)


def load(args: argparse.Namespace, given: ServingCost | None):
    """(target, draft, profile prompts [[max B, P], [max B, P'] longer], the trace recorded with the pair, each B's
    queue, a description); a bad B, or a `given` cost table that does not fit the trace, is refused before the live
    work (the real trace's before the models load)."""
    gamma = args.gamma
    if args.model == "real":
        from dspark.lab.demo.models import load_models
        from dspark.lab.replay.trace import DEFAULT_TRACE, load_trace
        from dspark.models.corpus import prompt_windows
        from dspark.models.draft import DEFAULT_WEIGHTS, file_sha256

        trace = load_trace(DEFAULT_TRACE, draft_sha256=file_sha256(DEFAULT_WEIGHTS))
        qs = check_trace(args, given, trace)  # before the models load
        target, draft, encode = load_models(torch.device("cpu"))
        prompts = [prompt_windows("heldout", encode, max(args.batch_sizes), n, 0) for n in (PROMPT_LEN, LONG_PROMPT_LEN)]
        return target, draft, prompts, trace, qs, "SmolLM2-135M-Instruct"
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from dspark.lab.replay.record import RecordSettings, record_trace
    from dspark.lab.replay.workload import Request
    from tests.engine_models import VOCAB, tiny_models

    target, draft = tiny_models(gamma=gamma)
    g = torch.Generator().manual_seed(7)
    requests = [Request(("code", "chat", "copy")[i % 3], torch.randint(3, VOCAB, (int(p),), generator=g), int(n))
                for i, (p, n) in enumerate(zip(torch.randint(4, 9, (24,), generator=g),
                                               torch.randint(3, 12, (24,), generator=g)))]
    trace = record_trace(target, draft, requests, draft_sha256="0" * 64,
                         settings=RecordSettings(gamma=gamma, max_batch=4))
    qs = check_trace(args, given, trace)
    prompts = [torch.randint(3, VOCAB, (max(args.batch_sizes), n), generator=g) for n in (8, 24)]
    return target, draft, prompts, trace, qs, "the tests' tiny Llama"


def check_trace(args: argparse.Namespace, given: ServingCost | None, trace: Trace) -> dict[int, ServingQueue]:
    """Each B's queue (`queues`); a bad B, or a `given` cost table of another draft, gamma or width than the trace's
    (SystemExit), refused."""
    qs = queues(args, trace)
    if given is not None:
        try:
            Lab(trace, given, args.gamma)
        except ValueError as e:
            raise SystemExit(f"--cost {args.cost}: {e}") from None
    return qs


def queues(args: argparse.Namespace, trace: Trace) -> dict[int, ServingQueue]:
    """Each B's fixed-concurrency queue of trace requests."""
    return {b: serving_queue(trace, b, requests_per_slot=args.requests_per_slot, fill_per_slot=args.fill_per_slot,
                             min_requests=args.min_requests) for b in args.batch_sizes}


def serving_cost(args: argparse.Namespace, decoder: SpecDecoder, prompts: list[torch.Tensor], trace: Trace,
                 bar: Progress) -> ServingCost:
    """The named cost, or with `same-run` this machine profiled now on the decoder's tier ladder."""
    if args.cost != "same-run":
        return load_serving_cost(args.cost, width=args.gamma + 1)
    from dspark.cost.shipped import ServingCostSpec
    from dspark.lab.profile import ProfileRuns
    from dspark.lab.serving_profile import profile_serving_cost

    sizes, w, ladder = sorted({1, *args.batch_sizes}), args.gamma + 1, decoder.tiers
    top = int(trace.new_tokens.max())
    spec = ServingCostSpec("same-run", "this CPU, profiled by perf/replay_live.py in the run it is compared with",
                           gamma=args.gamma, max_requests=max(sizes), tiers=ladder,
                           parameters={"gamma": args.gamma, "batch_sizes": sizes, "tier_ladder": list(ladder),
                                       "draft_sha256": trace.meta.get("draft_sha256")})
    return profile_serving_cost(
        lambda b: decoder.fork(tiers=[t for t in ladder if b <= t <= b * w] or None, reserve_new_tokens=top),
        prompts[0], sizes, spec, runs=ProfileRuns(PROFILE_TOKENS, args.profile_repeats), long_prompts=prompts[1],
        progress=bar)


def canary(decoder: SpecDecoder, prompts: torch.Tensor, seconds: float,
           gamma: int) -> Generator[StepOutcome, None, list]:
    """A lockstep run of B = len(prompts) requests on the profile's prompts and run length, one run per draft
    depth k = 0 .. gamma in turn (0: plain, static layout; else fixed-k, compact), restarted until its steps have
    taken `seconds` and every depth ran once; returns its full-batch steps."""
    steps: list[StepOutcome] = []
    taken, runs = 0.0, 0
    while taken < seconds or runs <= gamma:
        k, runs = runs % (gamma + 1), runs + 1
        mode = VerifyMode.STATIC if k == 0 else VerifyMode.COMPACT
        res = yield from decoder.start(prompts, PROFILE_TOKENS, FixedK(k), mode=mode)
        taken += sum(s.times.total for s in res.steps)
        steps += [s for s in res.steps if s.requests.numel() == prompts.shape[0]]
    return steps


def machine_speed(steps: list[StepOutcome], cost: ServingCost) -> dict[str, dict]:
    """Per draft depth of the canary's steps (str(k)): their mean verify rows, their draft and target seconds
    measured and priced by `cost`, and priced / measured - 1."""
    out, works = {}, [work_of(s) for s in steps]
    for k in sorted({w.drafts for w in works}):
        mine = [(s, w) for s, w in zip(steps, works) if w.drafts == k]
        measured = sum(s.times.draft + s.times.verify + s.times.accept for s, _ in mine)
        priced = sum(cost.price(dataclasses.replace(w, prefill_tokens=0)) for _, w in mine)
        out[str(k)] = {"steps": len(mine), "rows": statistics.fmean(w.rows for _, w in mine),
                       "measured_s": measured, "priced_s": priced, "error": priced / measured - 1.0}
    return out


def round_speed(sim: GenerateResult, widths: list[tuple[float, float]]) -> float:
    """The replay's machine speed at the rounds' speed: each step's priced seconds s scaled to s / (1 + e), e the
    canary's priced / measured - 1 at the step's verify rows (`widths`: (rows, e) per canary depth, linear between
    them, held past the ends); returns sum(s) / sum(s / (1 + e)) - 1 (for a cell of one width: that width's e)."""
    widths = sorted(widths)
    rows, errors = [w[0] for w in widths], [w[1] for w in widths]
    seconds = [(s.times.total, float(np.interp(work_of(s).rows, rows, errors))) for s in sim.steps]
    return sum(t for t, _ in seconds) / sum(t / (1.0 + e) for t, e in seconds) - 1.0


def cell(live: list[GenerateResult], sim: GenerateResult, trace: Trace, queue: ServingQueue, cost: ServingCost,
         temps, speed: float) -> dict:
    """One (policy, B): agreement of the first live round with the replay, live and replayed tok/s at fixed
    concurrency (medians over rounds), the gap with the replay at the rounds' machine speed (`speed`: the replay's
    `round_speed`), and the residual per phase (priced / measured - 1, medians)."""
    summaries = [run_summary(r, temps, queue.measured) for r in live]
    replay = run_summary(sim, temps, queue.measured)
    phases = [priced_phases(r, cost) for r in live]
    live_tok = statistics.median(s["tok_s"] for s in summaries)
    return {"agreement": step_agreement(live[0], sim, trace, queue.ids),
            "live_tok_s_runs": [s["tok_s"] for s in summaries], "live_tok_s": live_tok,
            "replay_tok_s": replay["tok_s"], "gap": replay["tok_s"] / live_tok - 1.0, "speed": speed,
            "gap_at_round_speed": replay["tok_s"] * (1.0 + speed) / live_tok - 1.0,
            "live_tpot_ms_p50": statistics.median(s["tpot_ms_p50"] for s in summaries),
            "replay_tpot_ms_p50": replay["tpot_ms_p50"],
            "full_concurrency": all(s["full_concurrency"] for s in summaries),
            "replay_vs_priced_live": sim.seconds / phases[0]["all"]["priced_s"] - 1.0,
            "phases": {p: {"measured_s": statistics.median(x[p]["measured_s"] for x in phases),
                           "priced_s": statistics.median(x[p]["priced_s"] for x in phases)}
                       for p in (*PHASES, "all")}}


def plot(cells: dict, path: Path) -> bool:
    """Replayed vs live tok/s, one point per (policy, B), the y = x line and the +-5 % band."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    top = 0.0
    for b, row in cells.items():
        xs = [c["live_tok_s"] for c in row.values()]
        ys = [c["replay_tok_s"] for c in row.values()]
        ax.scatter(xs, ys, label=f"B = {b}")
        for name, x, y in zip(row, xs, ys):
            ax.annotate(name, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
        top = max(top, *xs, *ys)
    line = [0.0, top * 1.1]
    ax.plot(line, line, "k-", lw=0.8, label="replay = live")
    ax.fill_between(line, [v * (1 - GOAL) for v in line], [v * (1 + GOAL) for v in line], color="grey", alpha=0.2,
                    label="+-5 %")
    ax.set_xlabel("live tok/s at fixed concurrency (measured)")
    ax.set_ylabel("replayed tok/s (cost model)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    from dspark.verify.layout import tier_ladder

    ladder, here = tier_ladder(tuple(args.batch_sizes), args.gamma + 1), f"{platform.machine()}-cpu"
    given = None
    if args.cost != "same-run":  # a bad name or another geometry is refused before any work
        try:
            given = load_serving_cost(args.cost, width=args.gamma + 1)
            live_tiers(given, here, ladder, args.batch_sizes, args.gamma + 1)
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"--cost {args.cost}: {e}") from None
    target, draft, prompts, trace, qs, what = load(args, given)
    longest = int(trace.prompt_offsets.diff().max() + trace.new_tokens.max())
    per_request = longest + 2 * (args.gamma + 1) + 64 + 16  # catch-up rows, a page
    decoder = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=max(args.batch_sizes) * per_request, tiers=ladder, clock="thread"))
    bar = Progress(len(args.batch_sizes) * (2 * len(POLICIES) + args.repeats)
                   + (len({1, *args.batch_sizes}) if args.cost == "same-run" else 0), print)
    cost = serving_cost(args, decoder, prompts, trace, bar)
    decoder = decoder.fork(tiers=live_tiers(cost, here, ladder, args.batch_sizes, args.gamma + 1))
    temps, _ = fit_trace_temperatures(trace, args.gamma)
    # live takes the replay's steps: the same gate, and refills folded as the live engine folds them
    lab = Lab(trace, cost, args.gamma, temperatures=temps, probe=UNTIMED_PROBE, fold_prefill=decoder.config.fold_prefill)
    cells: dict = {}
    machine: dict = {}
    for b, queue in qs.items():
        # forks per B, released after: a decoder keeps a captured step, with buffers for every tier, per B it ran
        decoders = {name: decoder.fork() for name in POLICIES}
        prompts_b = [trace.prompt(int(i)) for i in queue.ids]
        counts = trace.new_tokens[queue.ids].clone()
        for name in POLICIES:  # untimed warm-up: the first steps at new shapes are slow
            decoders[name].generate(prompts_b[:b], 2, lab.policy(name, b), max_batch=b)
            bar(f"B={b} warm-up {name}")
        sims = {name: dataclasses.replace(lab, estimators={}).run(name, b, queue.ids) for name in POLICIES}
        canary_decoder = decoder.fork()
        rounds: dict[str, list] = {name: [] for name in POLICIES}
        speeds = []
        for rep in range(args.repeats):
            order = list(POLICIES[rep % len(POLICIES):] + POLICIES[: rep % len(POLICIES)])
            labs = {name: dataclasses.replace(lab, estimators={}) for name in order}  # a fresh estimator per run
            runs = {name: decoders[name].start(prompts_b, counts, labs[name].policy(name, b),
                                               mode=VerifyMode.COMPACT, max_batch=b) for name in order}
            runs["canary"] = canary(canary_decoder, prompts[0][:b], max(sim.seconds for sim in sims.values()),
                                    args.gamma)
            results = lockstep(runs)
            for name in POLICIES:
                rounds[name].append(results[name])
            speeds.append(machine_speed(results["canary"], cost))
            bar(f"B={b} live round {rep + 1}/{args.repeats}")
        machine[b] = speeds
        widths = [(statistics.median(x[k]["rows"] for x in speeds), statistics.median(x[k]["error"] for x in speeds))
                  for k in speeds[0]]  # every round ran every depth (`canary`)
        cells[b] = {}
        for name in POLICIES:
            cells[b][name] = cell(rounds[name], sims[name], trace, queue, cost,
                                  temps if name != "adaptive-est" else None, round_speed(sims[name], widths))
            bar(f"B={b} replay {name}")
        del decoders, rounds
    out = {"command": "PYTHONPATH=. python perf/replay_live.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": what, "cost_model": cost.name, "cost": cost.to_dict(), "gamma": args.gamma, "temperatures": temps,
           "queues": {str(b): {"ids": q.ids.tolist(), "measured": [q.measured.start, q.measured.stop]}
                      for b, q in qs.items()}, "repeats": args.repeats,
           "tiers": list(decoder.tiers), "goal": GOAL,
           "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": 1, "clock": "thread"},
           "machine_speed": {str(b): rounds for b, rounds in machine.items()},
           "cells": {str(b): row for b, row in cells.items()}}
    out["within_goal"] = sum(abs(c["gap"]) <= GOAL for row in cells.values() for c in row.values())
    out["within_goal_at_round_speed"] = sum(abs(c["gap_at_round_speed"]) <= GOAL for row in cells.values()
                                            for c in row.values())
    out["cells_total"] = sum(len(row) for row in cells.values())
    out["seconds"] = time.perf_counter() - t0
    path = Path(args.out)
    write_json_atomic(path, out)
    plot(cells, path.with_suffix(".png"))
    print(f"{'B':>4} {'policy':>13} {'steps same':>11} {'live tok/s':>11} {'replay':>8} {'gap':>7} {'at speed':>9} "
          + " ".join(f"{p + ' err':>12}" for p in PHASES))
    for b, row in cells.items():
        for name, c in row.items():
            a, ph = c["agreement"], c["phases"]
            errs = [f"{ph[p]['priced_s'] / ph[p]['measured_s'] - 1:>+12.1%}" if ph[p]["measured_s"] else f"{'-':>12}"
                    for p in PHASES]
            print(f"{b:>4} {name:>13} {a['identical']:>5}/{a['compared']:<5} {c['live_tok_s']:>11.2f} "
                  f"{c['replay_tok_s']:>8.2f} {c['gap']:>+7.1%} {c['gap_at_round_speed']:>+9.1%} " + " ".join(errs))
    for b, speeds in machine.items():
        print(f"B = {b}: the canary's steps priced / measured - 1 per round, by depth (rows): "
              + "; ".join(f"{k} ({speeds[0][k]['rows']:.0f}) " + ", ".join(f"{x[k]['error']:+.1%}" for x in speeds)
                          for k in speeds[0]))
    print(f"{out['within_goal']}/{out['cells_total']} cells within {GOAL:.0%} "
          f"({out['within_goal_at_round_speed']} at the rounds' machine speed); wrote {path} and "
          f"{path.with_suffix('.png')} in {out['seconds']:.0f} s")
    return out


if __name__ == "__main__":
    main()
