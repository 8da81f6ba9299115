"""Calibration and ranking of a draft's confidence on SmolLM2 (issues 16 and 29's "must show").

Held-out code prompts (`corpus.prompt_windows("heldout", ..., seed)` for each of `--prompt-seeds`, the demo's
prompt kind) are decoded
greedily once (`dspark.models.stream_store`, cached under `--cache`); at every start of every stream the
draft's block gives its confidence logits, its distribution's features and the greedy accepted count
(`dspark.models.draft_eval.block_rows`, the rows the decode loop would record, nothing censored), and the soft
proxy 1 - TV(q, p). Requests are split (`--holdout`, by request): on the fit part, STS temperatures
(`dspark.calibration.fit.fit_temperatures`, NLL, the planner's calibration), a per-position affine (Platt)
variant c_k = sigmoid(a_k z_k + b_k) on the conditional event, and the online estimator replayed start by
start (`OnlineAcceptanceEstimator`, refit every 4 starts); on the held-out part, per draft position and event
(cumulative: the survival the planner reads; conditional: P(draft k accepted | reached k)): ECE (15 equal-width /
equal-mass bins) with the noise floor of a perfectly calibrated predictor of the same probabilities, Brier, and
AUROC with 95 % request-bootstrap intervals, for the head before / after STS, Platt, the estimator, its prior
(c = top-1 probability) and the top-2 margin (AUROC only), and the head's AUROC minus the estimator's and the
margin's with paired intervals (one bootstrap redraws the same requests for both). Then the seed's section
VII.A comparison for the head after STS against three targets: the soft 1 - TV proxy (on the accepted path),
the greedy prefix label at every start, and the runtime correct_lens at the decode loop's own step boundaries
(L = P, then L += accepted + 1).
Writes perf/results/engine_calibration.json.

    PYTHONPATH=. python perf/engine_calibration.py [--prompts 640] [--prompt-seeds 1,2,3,4] [--gamma 4] [--weights F]
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dspark.calibration.fit import METHODS, _json_clean, fit_temperatures, split_by_request
from dspark.calibration.metrics import (
    Sample,
    bootstrap_interval,
    ece_noise_floor,
    metric_functions,
    paired_difference_interval,
)
from dspark.calibration.online import OnlineAcceptanceEstimator, fit_logistic
from dspark.lab.demo.models import load_models
from dspark.models.corpus import prompt_windows
from dspark.models.draft import DEFAULT_WEIGHTS, file_sha256, load_draft
from dspark.models.draft_eval import block_rows
from dspark.models.stream_store import labelled_streams
from dspark.util.fileio import write_json_atomic
from dspark.util.options import at_least, int_list, output_path, real

BINS, LEVEL = 15, 0.95
FNS = metric_functions(BINS)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def score(p: np.ndarray, y: np.ndarray, groups: np.ndarray, bootstrap: int, seed: int, calibrated: bool = True) -> dict:
    """AUROC (0/1 labels only) and, for probabilities, ECE width / mass with floor and Brier; 95 % cluster CIs."""
    s = Sample.build(p, y, groups)
    out = {}
    names = (("ece_width", "ece_mass", "brier") if calibrated else ()) + (
        ("auroc",) if np.isin(y, (0.0, 1.0)).all() else ())
    for name in names:
        lo, hi = bootstrap_interval(FNS[name], s, bootstrap, LEVEL, np.random.default_rng(seed))
        out[name] = {"value": FNS[name](s, np.ones(s.p.size)), "ci": [lo, hi]}
    if calibrated:
        out["ece_floor"] = ece_noise_floor(p, BINS, "width", 20, np.random.default_rng(seed))
        out["mean_p"], out["mean_y"] = float(p.mean()), float(y.mean())
    return out


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def fit_platt(z: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """[g, 2] (bias, slope) per position: logistic fit of the conditional event on the reached rows."""
    return np.stack([fit_logistic(z[accepted >= k, k: k + 1], (accepted[accepted >= k] > k).astype(float),
                                  np.array([0.0, 1.0]), 1e-6) for k in range(z.shape[1])])


def replay_estimator(feats: torch.Tensor, accepted: torch.Tensor, gamma: int) -> OnlineAcceptanceEstimator:
    """The online estimator fed the fit requests start by start (every draft verified), as in serving."""
    est = OnlineAcceptanceEstimator(gamma, refit_every=4)
    full = torch.full((feats.shape[0],), gamma + 1, dtype=torch.int64)
    for i in range(feats.shape[1]):
        est.observe(verify_lens=full, correct_lens=accepted[:, i], features=feats[:, i])
    return est


def loop_starts(accepted: np.ndarray) -> np.ndarray:
    """[N, n] bool: the decode loop's step boundaries (offset 0, then += accepted + 1) per request."""
    keep = np.zeros(accepted.shape, bool)
    for r in range(accepted.shape[0]):
        i = 0
        while i < accepted.shape[1]:
            keep[r, i] = True
            i += int(accepted[r, i]) + 1
    return keep


def _event(c: np.ndarray, k: int, event: str) -> np.ndarray:
    """[R] the predicted probability of the event at draft k from conditional probabilities c [R, g]."""
    return np.prod(c[:, : k + 1], 1) if event == "cumulative" else c[:, k]


def tables(cond: dict, acc: np.ndarray, margin: np.ndarray, groups: np.ndarray, bootstrap: int, seed: int) -> list:
    """Per position and event: every model's scores ({name: c [R, g]}), the margin's AUROC, and the head's AUROC
    (after STS) minus the estimator's and the margin's with paired request-bootstrap intervals."""
    rows = []
    for k in range(acc.shape[1] if acc.ndim > 1 else next(iter(cond.values())).shape[1]):
        for event in ("cumulative", "conditional"):
            keep = np.ones(acc.shape[0], bool) if event == "cumulative" else acc >= k
            y = (acc[keep] > k).astype(float)
            row = {"position": k, "event": event, "rows": int(keep.sum()), "accept_rate": float(y.mean())}
            for name, c in cond.items():
                row[name] = score(_event(c, k, event)[keep], y, groups[keep], bootstrap, seed)
            m = margin[:, : k + 1].min(1) if event == "cumulative" else margin[:, k]
            row["margin"] = score(m[keep], y, groups[keep], bootstrap, seed, calibrated=False)
            head = Sample.build(_event(cond["head_sts"], k, event)[keep], y, groups[keep])
            row["head_auroc_minus"] = {}
            for name, other in (("estimator", _event(cond["estimator"], k, event)), ("margin", m)):
                lo, hi = paired_difference_interval(FNS["auroc"], head, Sample.build(other[keep], y, groups[keep]),
                                                    bootstrap, LEVEL, np.random.default_rng(seed))
                row["head_auroc_minus"][name] = {
                    "value": row["head_sts"]["auroc"]["value"] - row[name]["auroc"]["value"], "ci": [lo, hi]}
            rows.append(row)
    return rows


def section_vii_a(c: np.ndarray, soft: np.ndarray, acc: np.ndarray, loop: np.ndarray, groups: np.ndarray,
                  bootstrap: int, seed: int) -> list:
    """The head after STS against the soft proxy, the greedy prefix label and the runtime correct_lens."""
    rows = []
    for k in range(c.shape[1]):
        surv = np.prod(c[:, : k + 1], 1)
        reached = acc >= k
        r = {"position": k}
        r["soft_conditional"] = {**score(c[reached, k], soft[reached, k], groups[reached], bootstrap, seed),
                                 "spearman": spearman(c[reached, k], soft[reached, k])}
        r["soft_cumulative"] = score(surv, np.prod(soft[:, : k + 1], 1), groups, bootstrap, seed)
        for name, keep in (("greedy", np.ones_like(reached)), ("runtime", loop)):
            r[f"{name}_conditional"] = score(c[keep & reached, k], (acc[keep & reached] > k).astype(float),
                                             groups[keep & reached], bootstrap, seed)
            r[f"{name}_cumulative"] = score(surv[keep], (acc[keep] > k).astype(float), groups[keep], bootstrap, seed)
        rows.append(r)
    return rows


def _cell(d: dict, key: str) -> str:
    if key not in d:
        return "-"
    v, (lo, hi) = d[key]["value"], d[key]["ci"]
    return f"{v:.4f}" if key != "auroc" else f"{v:.3f} [{lo:.3f},{hi:.3f}]"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=at_least(1), default=640, help="held-out code prompts (requests) per seed")
    ap.add_argument("--prompt-seeds", type=int_list(0), default=(1, 2, 3, 4),
                    help="prompt draws, concatenated (four: 61 440 held-out rows per position, ECE floors under "
                         "0.5 %%)")
    ap.add_argument("--new-tokens", type=at_least(1), default=32, help="starts per stream")
    ap.add_argument("--prompt-len", type=at_least(1), default=32)
    ap.add_argument("--gamma", type=at_least(1), default=4)
    ap.add_argument("--stream-gamma", type=at_least(1), default=6,
                    help="streams hold new-tokens + stream-gamma - 1 tokens (6: shared with perf/draft_acceptance.py)")
    ap.add_argument("--holdout", type=real(0, 1, low_open=True, high_open=True), default=0.75,
                    help="share of requests held out (STS fits one temperature per position: a quarter is plenty)")
    ap.add_argument("--sts-method", choices=METHODS, default="nll",
                    help="STS fit objective (nll: the planner's default, `dspark calibrate --method`)")
    ap.add_argument("--bootstrap", type=at_least(0), default=50)
    ap.add_argument("--seed", type=at_least(0), default=1)
    ap.add_argument("--threads", type=at_least(1), default=1)
    ap.add_argument("--weights", type=Path, default=None, help=f"draft file (default {DEFAULT_WEIGHTS})")
    ap.add_argument("--cache", type=Path, default=None, help="stream cache folder (read and written)")
    ap.add_argument("--out", type=output_path(), default="perf/results/engine_calibration.json")
    args = ap.parse_args(argv)
    if args.stream_gamma < args.gamma:
        ap.error(f"--stream-gamma {args.stream_gamma} must be >= --gamma {args.gamma}")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    target, draft, encode = load_models(torch.device("cpu"))
    if args.weights is not None:
        draft = load_draft(target, args.weights)
    prompts = torch.cat([prompt_windows("heldout", encode, args.prompts, args.prompt_len, seed)
                         for seed in args.prompt_seeds])
    with target.own_attention() as model:
        streams = labelled_streams(model, prompts, args.new_tokens + args.stream_gamma - 1, batch=64,
                                   cache=args.cache, log=lambda m: print(m, flush=True))
        lm_head = model.get_output_embeddings().weight.detach()
    t1 = time.perf_counter()
    rows = block_rows(draft, streams, args.gamma, args.new_tokens, lm_head=lm_head)
    t2 = time.perf_counter()
    held = split_by_request(torch.arange(prompts.shape[0]), args.holdout, args.seed).numpy()
    n, g = args.new_tokens, args.gamma
    z, acc = rows["conf"].double().numpy(), rows["accepted"].numpy()
    flat = lambda x, m: x[m].reshape(-1, *x.shape[2:])  # noqa: E731  [requests, n, ...] -> [rows, ...]
    labels = (np.arange(g) < flat(acc, ~held)[:, None]).astype(np.float64)
    fits = fit_temperatures(torch.from_numpy(flat(z, ~held)), torch.from_numpy(labels), method=args.sts_method)
    temps = np.array([f.temperature for f in fits])
    platt = fit_platt(flat(z, ~held), flat(acc, ~held))
    est = replay_estimator(rows["features"][torch.from_numpy(~held)], rows["accepted"][torch.from_numpy(~held)], g)
    zh, ah, fh = flat(z, held), flat(acc, held), rows["features"][torch.from_numpy(held)].flatten(0, 1)
    groups = np.repeat(np.flatnonzero(held), n)
    cond = {"head_raw": _sigmoid(zh), "head_sts": _sigmoid(zh / temps),
            "head_platt": _sigmoid(platt[:, 0] + platt[:, 1] * zh),
            "estimator": torch.sigmoid(est.predict(fh).double()).numpy(),
            "prior": torch.sigmoid(fh[..., 0].double()).numpy()}
    table = tables(cond, ah, fh[..., 1].double().numpy(), groups, args.bootstrap, args.seed)
    loop = flat(loop_starts(acc), held)
    vii = section_vii_a(cond["head_sts"], flat(rows["soft"].double().numpy(), held), ah, loop, groups,
                        args.bootstrap, args.seed)
    t3 = time.perf_counter()
    at_bound = [f.position for f in fits if f.at_bound]
    print(f"{streams.tokens.shape[0]} streams ({streams.seconds:.0f} s target time, read in {t1 - t0:.0f} s); block "
          f"rows {t2 - t1:.0f} s; fit + report {t3 - t2:.0f} s; held-out {int(held.sum())} requests x {n} starts")
    bound = f"at a search bound: {at_bound}" if at_bound else "inside the search bounds"
    print(f"STS temperatures {np.round(temps, 3).tolist()} ({bound}); Platt (bias, slope) "
          f"{np.round(platt, 3).tolist()}")
    models = list(cond)
    print(f"{'event':<11}{'k':>2}{'rows':>7}{'rate':>6} | ECE width (mass) per model: {' / '.join(models)} | "
          f"AUROC: {' / '.join(models + ['margin'])}")
    for r in table:
        eces = "  ".join(f"{r[m]['ece_width']['value']:.4f}({r[m]['ece_mass']['value']:.4f})" for m in models)
        aucs = "  ".join(_cell(r[m], "auroc") for m in models + ["margin"])
        diffs = "  ".join(f"{name} {d['value']:+.4f} [{d['ci'][0]:+.4f},{d['ci'][1]:+.4f}]"
                          for name, d in r["head_auroc_minus"].items())
        print(f"{r['event']:<11}{r['position']:>2}{r['rows']:>7}{r['accept_rate']:6.3f} | {eces} | {aucs}  "
              f"floor {r['head_sts']['ece_floor']:.4f} | head AUROC minus {diffs}")
    print("section VII.A, head after STS: mean c / mean target, ECE width, Brier (AUROC; Spearman for the soft proxy)")
    for r in vii:
        cells = []
        for key in ("soft_conditional", "soft_cumulative", "greedy_conditional", "greedy_cumulative",
                    "runtime_conditional", "runtime_cumulative"):
            d = r[key]
            extra = (f" rho {d['spearman']:.3f}" if "spearman" in d else
                     f" auc {d['auroc']['value']:.3f}" if "auroc" in d else "")
            cells.append(f"{key} {d['mean_p']:.3f}/{d['mean_y']:.3f} ece {d['ece_width']['value']:.4f} brier "
                         f"{d['brier']['value']:.4f}{extra}")
        print(f"k{r['position']}: " + "; ".join(cells))
    cum = [r for r in table if r["event"] == "cumulative"]
    summary = {
        "command": "PYTHONPATH=. python perf/engine_calibration.py "
                   + " ".join(sys.argv[1:] if argv is None else argv),
        "draft_sha256": file_sha256(args.weights or DEFAULT_WEIGHTS), "platform": platform.machine(),
        "threads": args.threads, "streams": list(streams.tokens.shape), "target_seconds": streams.seconds,
        "heldout_requests": int(held.sum()), "sts_method": args.sts_method, "temperatures": temps.tolist(),
        "temperature_at_bound": at_bound,
        "platt": platt.tolist(), "estimator_parameters": est.parameters.tolist(), "table": table,
        "section_vii_a": vii,
        "ece_sts_le_1pct_every_position": all(
            max(r["head_sts"]["ece_width"]["value"], r["head_sts"]["ece_mass"]["value"]) <= 0.01 for r in cum),
        "sts_never_worse": all(r["head_sts"]["ece_width"]["value"] <= r["head_raw"]["ece_width"]["value"] for r in cum),
        "head_auroc_ge_margin_and_estimator": all(r["head_sts"]["auroc"]["value"] >= max(
            r["margin"]["auroc"]["value"], r["estimator"]["auroc"]["value"]) for r in table),
        "head_auroc_significantly_below": sorted({f"{name} at {r['event']} {r['position']}" for r in table
                                                  for name, d in r["head_auroc_minus"].items() if d["ci"][1] < 0}),
        "seconds": round(t3 - t0, 1)}
    write_json_atomic(args.out, _json_clean(summary))
    print(f"ECE after STS <= 1 % at every position: {summary['ece_sts_le_1pct_every_position']}; STS never worse: "
          f"{summary['sts_never_worse']}; head AUROC >= margin and estimator everywhere: "
          f"{summary['head_auroc_ge_margin_and_estimator']}; significantly below (paired 95 % interval under 0): "
          f"{summary['head_auroc_significantly_below'] or 'nowhere'}\nwrote {args.out}")
    return summary


if __name__ == "__main__":
    main()
