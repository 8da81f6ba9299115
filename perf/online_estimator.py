"""The online acceptance estimator on the real model (issue 18's "must show"): calibration and throughput.

1. Calibration. SmolLM2-135M-Instruct and its shipped draft; on `--prompts` held-out prompt windows the
   target's greedy streams and, at every start of every stream, the draft's block (teacher-forced, the rows
   the decode loop sees: `dspark.lab.calibrate.block_outcomes`): the head's confidence logits, the draft
   features (`draft_features`, computed per chunk: the [rows, starts, gamma, V] logits never leave the
   chunk) and the greedy accepted-draft count. Requests are split 3/4 train, 1/4 held out
   (`split_by_request`). The estimator replays the train rows online (one step = one start of every train
   request, uncensored: every draft verified) and is scored on the held-out rows; the head gets STS
   temperatures fit on the train rows. Per position and event (conditional: P(draft k accepted | prefix
   reached k); cumulative: the survival the planner reads) on the held-out rows: AUROC and ECE (15 equal-
   width bins) with 95 % cluster-bootstrap intervals over requests, for the estimator, its warm-up prior
   (c = top-1 probability), the head after and before STS and the plain top-2 margin (AUROC only: a score,
   not a probability); also the estimator's prequential score on the train stream (each step predicted
   before it was observed: what the planner saw while it learned).
2. Throughput (`--batch-sizes`, skipped with `--no-throughput`). The demo's procedure, shortened: profile the
   step costs and fit the cost model, and the draft per depth (`serving_cost_of_steps`), then per B serve a
   queue of `--requests-per-slot` x B prompts by continuous batching with fixed-0..gamma, adaptive with the
   head (STS temperatures from step 1) and adaptive with the estimator (head off), both choosing the draft
   depth per step as the demo's do (each depth priced by its own draft), all in `lockstep`, `--repeats`
   rounds; every run's greedy tokens must equal fixed-0's. One estimator serves every run (as in a server: it
   starts from the prior at the first warm-up and keeps learning); as in the demo each adaptive policy warms
   up on the whole queue and every round's resumes from the one before (`Adaptive.resume`: its realised
   acceptance). Reported: committed tokens/s over the queue (median over rounds) and each adaptive's
   per-round ratio to the best fixed k (median).

Prints both tables and writes perf/results/online_estimator.json.

    PYTHONPATH=. python perf/online_estimator.py [--prompts 256] [--new-tokens 40] [--batch-sizes 1 4 16]
"""
from __future__ import annotations

import argparse
import functools
import math
import platform
import statistics
import time

import numpy as np
import torch

from dspark.calibration.fit import _json_clean, fit_temperatures, split_by_request
from dspark.calibration.metrics import Sample, bootstrap_interval, metric_functions
from dspark.calibration.online import OnlineAcceptanceEstimator, draft_features
from dspark.config import VerifyMode
from dspark.cost.shipped import ServingCostSpec
from dspark.lab.calibrate import block_outcomes
from dspark.lab.demo.config import DemoConfig, request_lengths
from dspark.lab.demo.models import load_models
from dspark.lab.profile import ProfileRuns, fit_cost_model, profile_points, profile_step_costs
from dspark.lab.serving_profile import ProfiledPlanners, serving_cost_of_steps
from dspark.lab.timing import lockstep, resumed
from dspark.models.corpus import prompt_windows
from dspark.models.streams import greedy_streams
from dspark.plan.planner import PlannerSettings
from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import Adaptive, make_policy
from dspark.serve.policies.gate import GateSettings
from dspark.util.fileio import write_json_atomic
from dspark.util.options import at_least, output_path
from dspark.verify.layout import tier_ladder

NUM_BINS = 15
LEVEL = 0.95


@torch.no_grad()
def collect(decoder: SpecDecoder, prompts: torch.Tensor, gamma: int, new_tokens: int, rows: int) -> dict:
    """Per request and start: head logits [N, n, g], draft features [N, n, g, 3], accepted drafts [N, n]."""
    with decoder.target.own_attention() as model:
        streams, hidden = greedy_streams(model, prompts.to(decoder.device), new_tokens + gamma - 1, batch=32)
    conf, feats, accepted = [], [], []
    for sub in range(0, streams.shape[0], rows):
        c, logits, a = block_outcomes(decoder.draft, streams[sub: sub + rows], hidden[sub: sub + rows],
                                      prompts.shape[1], gamma, new_tokens)
        conf.append(c.cpu())
        reduced = logits.index_select(-1, decoder.draft.vocab_ids)  # the engine's input: same features, 1/12 the V
        feats.append(draft_features(reduced.flatten(0, 1)).unflatten(0, logits.shape[:2]).cpu())
        accepted.append(a.cpu())
    return {"conf": torch.cat(conf), "feats": torch.cat(feats), "accepted": torch.cat(accepted)}


def train_estimator(est: OnlineAcceptanceEstimator, feats: torch.Tensor, accepted: torch.Tensor) -> np.ndarray:
    """Replay train rows [R, n, ...] start by start; returns the prequential conditional c [R, n, g]."""
    g = feats.shape[2]
    full = torch.full((feats.shape[0],), g + 1, dtype=torch.int64)
    online = []
    for i in range(feats.shape[1]):
        online.append(torch.sigmoid(est.predict(feats[:, i]).double()))
        est.observe(verify_lens=full, correct_lens=accepted[:, i], features=feats[:, i])
    return torch.stack(online, 1).numpy()


def _score(p: np.ndarray, y: np.ndarray, groups: np.ndarray, bootstrap: int, seed: int, ece: bool = True) -> dict:
    """AUROC (and ECE) with cluster-bootstrap intervals over requests."""
    sample = Sample.build(p, y, groups)
    out = {}
    fns = metric_functions(NUM_BINS)
    for name in ("auroc", "ece_width") if ece else ("auroc",):
        lo, hi = bootstrap_interval(fns[name], sample, bootstrap, LEVEL, np.random.default_rng(seed))
        out[name] = {"value": fns[name](sample, np.ones(sample.p.size)), "ci": [lo, hi]}
    return out


def calibration_report(data: dict, train: torch.Tensor, est: OnlineAcceptanceEstimator, online: np.ndarray,
                       bootstrap: int, seed: int) -> list[dict]:
    """Per position and event, on the held-out requests (and the estimator's prequential train stream)."""
    held = ~train
    n_starts, g = data["conf"].shape[1], data["conf"].shape[2]
    acc = data["accepted"].double().numpy()                         # [N, n]
    y_tr = (torch.arange(g) < data["accepted"][train].unsqueeze(-1)).double().flatten(0, 1)
    temps = [f.temperature for f in fit_temperatures(data["conf"][train].flatten(0, 1), y_tr)]
    f_h, z_h = data["feats"][held].flatten(0, 1), data["conf"][held].flatten(0, 1).double()
    cond = {"estimator": torch.sigmoid(est.predict(f_h).double()).numpy(),
            "prior": torch.sigmoid(f_h[..., 0].double()).numpy(),
            "head_sts": torch.sigmoid(z_h / torch.tensor(temps, dtype=torch.float64)).numpy(),
            "head_raw": torch.sigmoid(z_h).numpy()}
    margin = f_h[..., 1].double().numpy()
    a_h = acc[held.numpy()].reshape(-1)
    groups = np.repeat(np.flatnonzero(held.numpy()), n_starts)
    a_tr, g_tr = acc[train.numpy()].reshape(-1), np.repeat(np.flatnonzero(train.numpy()), n_starts)
    online = online.reshape(-1, g)
    rows = []
    for k in range(g):
        for event in ("conditional", "cumulative"):
            if event == "conditional":
                keep, keep_tr = a_h >= k, a_tr >= k
                probs = {m: c[:, k] for m, c in cond.items()}
                probs["estimator_online"] = online[:, k]
                score_m = margin[:, k]
            else:
                keep, keep_tr = np.ones_like(a_h, bool), np.ones_like(a_tr, bool)
                probs = {m: np.prod(c[:, : k + 1], axis=1) for m, c in cond.items()}
                probs["estimator_online"] = np.prod(online[:, : k + 1], axis=1)
                score_m = margin[:, : k + 1].min(1)
            y, y_tr_k = (a_h > k).astype(float), (a_tr > k).astype(float)
            if not keep.any() or not keep_tr.any():
                continue
            row = {"position": k, "event": event, "rows": int(keep.sum()), "accept_rate": float(y[keep].mean())}
            for m, p in probs.items():
                if m == "estimator_online":
                    row[m] = _score(p[keep_tr], y_tr_k[keep_tr], g_tr[keep_tr], bootstrap, seed)
                else:
                    row[m] = _score(p[keep], y[keep], groups[keep], bootstrap, seed)
            row["margin"] = _score(score_m[keep], y[keep], groups[keep], bootstrap, seed, ece=False)
            rows.append(row)
    return rows, temps


def throughput(decoder: SpecDecoder, encode, est: OnlineAcceptanceEstimator, temps: list[float], args) -> dict:
    """The demo's lockstep comparison, shortened: fixed-0..gamma, adaptive (head), adaptive (estimator)."""
    gamma, bmax = args.gamma, max(args.batch_sizes)
    n = args.requests_per_slot * bmax
    prompts = (prompt_windows("heldout", encode, n, args.prompt_len, args.seed) if encode is not None else
               torch.randint(0, decoder.target.geometry.vocab_size, (n, args.prompt_len),
                             generator=torch.Generator().manual_seed(args.seed)))
    lengths = request_lengths(prompts.shape[0], args.max_new_tokens, 0.5, args.seed)
    grid = profile_points(args.batch_sizes, gamma, decoder.tiers)
    t0 = time.perf_counter()
    profiled, runs = decoder.fork(reserve_new_tokens=int(lengths.max())), ProfileRuns(args.max_new_tokens,
                                                                                       args.profile_repeats)
    samples, plain = profile_step_costs(profiled, prompts, grid, gamma, runs=runs)
    cost, _, _ = fit_cost_model(samples, gamma, platform=f"{platform.machine()}-cpu", tiers=decoder.tiers)
    # the draft per depth too, as the demo profiles it: a policy choosing a shallower depth is priced for it
    sizes = sorted({1, *args.batch_sizes})
    spec = ServingCostSpec("same-run", "this CPU, profiled by perf/online_estimator.py", gamma=gamma,
                           max_requests=max(sizes), tiers=decoder.tiers,
                           parameters={"gamma": gamma, "batch_sizes": sizes, "tier_ladder": list(decoder.tiers)})
    serving = serving_cost_of_steps(profiled, prompts, (samples, plain), sizes, spec, runs=runs)
    print(f"profiled {len(grid)} points and the draft per depth in {time.perf_counter() - t0:.0f} s")

    # as the demo: served with the tiers worth replaying (`serving_tiers`), greedy decoding at lag 0 planned by the
    # live argmax, the demo's probe schedule
    if decoder.tiers:
        decoder = decoder.fork(tiers=cost.tiers)
    planner = ProfiledPlanners(cost, serving, decoder, temps, PlannerSettings(lag=0, num_slots=bmax, live_argmax=True))
    demo = DemoConfig()
    gate = GateSettings.probing((demo.probe_every, demo.max_probe_every, demo.cost_feedback),
                                serving.drafter.per_catch_up_token, prefill_token_seconds=serving.prefill.per_token)

    def make(name: str, b: int):
        policy = {"adaptive-head": "adaptive", "adaptive-estimator": "adaptive-est"}.get(name, name)
        return make_policy(policy, gamma, functools.partial(planner, b), plain.step_seconds, gate, est,
                           choose_depth=True)

    names = [f"fixed-{k}" for k in range(gamma + 1)] + ["adaptive-head", "adaptive-estimator"]
    decoders = {n: decoder.fork() for n in names}
    out = {}
    for b in args.batch_sizes:
        queue, counts = prompts[: args.requests_per_slot * b], lengths[: args.requests_per_slot * b]
        # untimed warm-up at this B, as the demo's: an adaptive policy serves the whole queue (it learns its
        # realised acceptance) and every timed round's resumes from the one before, as a server's is warm
        earlier = {}  # name -> the policy of its last run at this B
        for n in names:
            earlier[n] = policy = make(n, b)
            warm = (queue, counts) if isinstance(policy, Adaptive) else (queue[:b], max(2, args.max_new_tokens // 4))
            decoders[n].generate(*warm, policy, max_batch=b)
        tps: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(args.repeats):
            order = names[rep % len(names):] + names[: rep % len(names)]
            policies = earlier = resumed({n: make(n, b) for n in order}, earlier)
            res = lockstep({n: decoders[n].start(queue, counts, policies[n], mode=VerifyMode.COMPACT, max_batch=b)
                            for n in order})
            for n in names:
                if not torch.equal(res[n].tokens, res["fixed-0"].tokens):
                    raise AssertionError(f"{n} at B={b} is not lossless (tokens differ from fixed-0)")
                tps[n].append(float(counts.sum()) / res[n].seconds)
        med = {n: statistics.median(v) for n, v in tps.items()}
        best = max((n for n in names if n.startswith("fixed-")), key=med.__getitem__)
        out[b] = {"tokens_per_s": med, "rounds": tps, "best_fixed": best,
                  **{f"{a}_vs_best_fixed": statistics.median(x / y for x, y in zip(tps[a], tps[best]))
                     for a in ("adaptive-head", "adaptive-estimator")}}
        print(f"B={b:>2}: best fixed {best} {med[best]:.1f} tok/s; adaptive-head {med['adaptive-head']:.1f} "
              f"({out[b]['adaptive-head_vs_best_fixed']:.2f}x); adaptive-estimator {med['adaptive-estimator']:.1f} "
              f"({out[b]['adaptive-estimator_vs_best_fixed']:.2f}x)")
    return {"results": out, "estimator_refits": est.refits, "estimator_steps": est.steps_observed,
            "cost_model": cost.kind, "lossless_vs_fixed0": True}


def overhead(gamma: int, vocab: int, batch_sizes: list[int], window: int, steps: int = 40) -> dict:
    """Median host seconds per step of the estimator's own work on synthetic draft-vocabulary logits (one
    thread): confidence_logits (features + model), observe without a refit, and one refit of a full window."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    for b in batch_sizes:
        est = OnlineAcceptanceEstimator(gamma, refit_every=10**9, window=window)
        times: dict[str, list[float]] = {"confidence_logits": [], "observe": [], "refit": []}
        step = 0
        while step < steps or est.labels_seen.min() < window:  # timed steps, then fill every window (untimed)
            x = torch.randn(b, gamma, vocab, generator=gen) * 4
            t0 = time.perf_counter()
            est.confidence_logits(x)
            t1 = time.perf_counter()
            est.observe(verify_lens=torch.full((b,), gamma + 1), correct_lens=torch.randint(0, gamma + 1, (b,),
                                                                                          generator=gen))
            t2 = time.perf_counter()
            if step < steps:
                times["confidence_logits"].append(t1 - t0)
                times["observe"].append(t2 - t1)
            step += 1
        for _ in range(5):
            t0 = time.perf_counter()
            est.refit()
            times["refit"].append(time.perf_counter() - t0)
        out[b] = {k: statistics.median(v) for k, v in times.items()}
        print(f"estimator overhead B={b:>2}: confidence_logits {1e3 * out[b]['confidence_logits']:.2f} ms, "
              f"observe {1e3 * out[b]['observe']:.2f} ms, refit ({window} labels per position) "
              f"{1e3 * out[b]['refit']:.1f} ms")
    return out


def _cell(d: dict, key: str) -> str:
    v, (lo, hi) = d[key]["value"], d[key]["ci"]
    return "  n/a" if not math.isfinite(v) else f"{v:.3f} [{lo:.3f}, {hi:.3f}]"


def load(model: str, gamma: int, prompts: int, prompt_len: int, seed: int):
    """(target, draft, encode or None, prompts [N, P]): SmolLM2 and its shipped draft with held-out prompt
    windows (`real`), or the tests' tiny Llama + distilled draft with random prompts (`tiny`)."""
    if model == "real":
        target, draft, encode = load_models(torch.device("cpu"))
        return target, draft, encode, prompt_windows("heldout", encode, prompts, prompt_len, seed + 2)
    if model == "tiny":
        from tests.engine_models import VOCAB, tiny_models

        target, draft = tiny_models(gamma=gamma)
        return target, draft, None, torch.randint(0, VOCAB, (prompts, prompt_len),
                                                  generator=torch.Generator().manual_seed(seed + 2))
    raise ValueError(f"--model must be real or tiny, got {model!r}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="real", choices=("real", "tiny"))
    ap.add_argument("--prompts", type=at_least(1), default=256)
    ap.add_argument("--new-tokens", type=at_least(1), default=40)
    ap.add_argument("--gamma", type=at_least(1), default=4)
    ap.add_argument("--prompt-len", type=at_least(1), default=32)
    ap.add_argument("--rows", type=at_least(1), default=4, help="requests per draft block pass (memory: rows x starts x V)")
    ap.add_argument("--refit-every", type=at_least(1), default=4)
    ap.add_argument("--bootstrap", type=at_least(0), default=200)
    ap.add_argument("--batch-sizes", type=at_least(1), nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-new-tokens", type=at_least(1), default=16)
    ap.add_argument("--requests-per-slot", type=at_least(1), default=2)
    ap.add_argument("--repeats", type=at_least(1), default=2)
    ap.add_argument("--profile-repeats", type=at_least(1), default=1)
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--overhead-only", action="store_true",
                    help="only the estimator's per-step host cost (synthetic logits over the draft's 4096 tokens)")
    ap.add_argument("--seed", type=at_least(0), default=0)
    ap.add_argument("--out", type=output_path(), default="perf/results/online_estimator.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    if args.overhead_only:
        summary = {"config": vars(args), "overhead_seconds": overhead(args.gamma, 4096, args.batch_sizes, 4096)}
        write_json_atomic(args.out.replace(".json", "_overhead.json"), summary)
        return summary
    target, draft, encode, prompts = load(args.model, args.gamma, args.prompts, args.prompt_len, args.seed)
    print(f"models loaded in {time.perf_counter() - t_start:.0f} s")
    per_request = args.prompt_len + 2 * args.max_new_tokens + args.gamma + 1 + 64 + 16
    decoder = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=max(args.batch_sizes + [2]) * per_request, tiers=tier_ladder(args.batch_sizes, args.gamma + 1), clock="thread"))
    t0 = time.perf_counter()
    data = collect(decoder, prompts, args.gamma, args.new_tokens, args.rows)
    print(f"collected {args.prompts} x {args.new_tokens} starts in {time.perf_counter() - t0:.0f} s")
    train = ~split_by_request(torch.arange(args.prompts), 0.25, args.seed)
    est = OnlineAcceptanceEstimator(args.gamma, refit_every=args.refit_every)
    online = train_estimator(est, data["feats"][train], data["accepted"][train])
    rows, temps = calibration_report(data, train, est, online, args.bootstrap, args.seed)
    models = ("estimator", "estimator_online", "prior", "head_sts", "head_raw")
    print(f"held-out AUROC / ECE [{LEVEL:.0%} bootstrap CI over requests], {int((~train).sum())} held-out requests")
    print(f"{'k':>2} {'event':<11} {'rows':>5} {'acc':>5}  " + "  ".join(f"{m:<26}" for m in models + ("margin",)))
    for r in rows:
        for metric in ("auroc", "ece_width"):
            cells = [_cell(r[m], metric) for m in models] + [_cell(r["margin"], "auroc") if metric == "auroc" else
                                                             "-"]
            head = f"{r['position']:>2} {r['event']:<11} {r['rows']:>5} {r['accept_rate']:5.2f}" if metric == "auroc" \
                else " " * 25
            print(f"{head}  {metric:<5} " + "  ".join(f"{c:<26}" for c in cells))
    summary = {"config": vars(args), "machine": {"platform": platform.platform(), "torch": torch.__version__,
                                                 "threads": 1},
               "calibration": {"rows": rows, "sts_temperatures": temps, "estimator_parameters":
                               est.parameters.tolist(), "estimator_refits": est.refits,
                               "held_out_requests": int((~train).sum())}}
    if not args.no_throughput:
        est_serving = OnlineAcceptanceEstimator(args.gamma, refit_every=args.refit_every)
        summary["throughput"] = throughput(decoder, encode, est_serving, temps, args)
    summary["seconds"] = time.perf_counter() - t_start
    write_json_atomic(args.out, _json_clean(summary))
    print(f"wrote {args.out} ({summary['seconds']:.0f} s)")
    return _json_clean(summary)


if __name__ == "__main__":
    main()
