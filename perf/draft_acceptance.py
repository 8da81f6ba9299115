"""Held-out greedy acceptance of draft files per prompt kind (issue 29's "must show"), with counts.

Per kind (`dspark.models.kinds`): `code` = the demo's held-out prompts (`corpus.prompt_windows("heldout", ...)`,
32 tokens), `chat` and `edit` = the training run's held-out prompts of those kinds (`train_data.draw_prompts`,
the draw `train_draft` measures on). The target's greedy streams are decoded once (`stream_store`, cached under
`--cache` so every draft file, and `perf/engine_calibration.py`, read the same streams); each draft's block is
taken at every start with all gamma drafts in the stream (`dspark.models.draft_eval.block_rows`) and matched
greedily against it. Printed and written per file and kind: starts, reached / accepted / conditional rate per
draft position, mean accepted drafts per start with the first k drafts verified (k = 1..gamma).

    PYTHONPATH=. python perf/draft_acceptance.py [--weights F ...] [--code-prompts 640] [--kind-prompts 64]
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

from dspark.lab.demo.models import load_models
from dspark.models.confidence_fit import acceptance
from dspark.models.corpus import prompt_windows
from dspark.models.draft import DEFAULT_WEIGHTS, file_sha256, load_draft
from dspark.models.draft_eval import block_rows
from dspark.models.kinds import KINDS, PROMPT_LEN
from dspark.models.stream_store import labelled_streams
from dspark.models.train_data import draw_prompts
from dspark.util.fileio import write_json_atomic
from dspark.util.options import at_least, output_path


def accepted_table(accepted: torch.Tensor, gamma: int) -> dict:
    """`confidence_fit.acceptance` of greedy accepted-draft counts [N, n] (labels: count > k, masks: >= k)."""
    a = accepted.reshape(-1, 1)
    k = torch.arange(gamma)
    return acceptance((a > k).float(), a >= k)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", type=Path, nargs="+", default=[DEFAULT_WEIGHTS], help="draft files to measure")
    ap.add_argument("--code-prompts", type=at_least(1), default=640)
    ap.add_argument("--kind-prompts", type=at_least(0), default=64, help="held-out chat and edit prompts each")
    ap.add_argument("--new-tokens", type=at_least(1), default=37,
                    help="greedy tokens per code stream (starts: new-tokens - gamma + 1; 37: engine_calibration's)")
    ap.add_argument("--kind-new-tokens", type=at_least(1), default=40,
                    help="greedy tokens per chat / edit stream (40 = the trainer's held-out streams)")
    ap.add_argument("--gamma", type=at_least(1), default=6)
    ap.add_argument("--code-seed", type=at_least(0), default=1)
    ap.add_argument("--seed", type=at_least(0), default=0, help="the chat / edit draw (train_draft's held-out seed)")
    ap.add_argument("--cache", type=Path, default=None, help="stream cache folder (read and written)")
    ap.add_argument("--threads", type=at_least(1), default=1)
    ap.add_argument("--out", type=output_path(), default="perf/results/draft_acceptance.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    target, draft, encode = load_models(torch.device("cpu"))
    prompts = {"code": prompt_windows("heldout", encode, args.code_prompts, 32, args.code_seed)}
    for kind in KINDS[1:]:
        if args.kind_prompts:
            prompts[kind] = draw_prompts(kind, "heldout", encode, args.kind_prompts, PROMPT_LEN[kind], args.seed)
    new = {k: args.new_tokens if k == "code" else args.kind_new_tokens for k in prompts}
    if min(new.values()) < args.gamma:
        ap.error(f"every stream needs >= gamma = {args.gamma} new tokens, got {new}")
    with target.own_attention() as model:
        streams = {k: labelled_streams(model, p, new[k], batch=64, cache=args.cache,
                                       log=lambda m, k=k: print(f"{k} {m}", flush=True)) for k, p in prompts.items()}
    results = {}
    for path in args.weights:
        d = load_draft(target, path) if Path(path).resolve() != DEFAULT_WEIGHTS.resolve() else draft
        per_kind = {k: accepted_table(block_rows(d, s, args.gamma, new[k] - args.gamma + 1)["accepted"], args.gamma)
                    for k, s in streams.items()}
        results[str(path)] = {"sha256": file_sha256(Path(path)), "per_kind": per_kind}
        print(f"\n{path} (sha256 {results[str(path)]['sha256'][:12]}):")
        print(f"{'kind':<5} {'starts':>6} | {'rate per draft position (reached)':<66} | mean accepted at gamma 1..g")
        for k, a in per_kind.items():
            rates = " ".join(f"{r:.3f}({n})" for r, n in zip(a["rate"], a["reached"]))
            means = " ".join(f"{m:.3f}" for m in a["mean_accepted_by_gamma"])
            print(f"{k:<5} {a['starts']:>6} | {rates:<66} | {means}")
    summary = {"command": "PYTHONPATH=. python perf/draft_acceptance.py "
                   + " ".join(sys.argv[1:] if argv is None else argv),
               "config": {k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if k == "weights" else v)
                          for k, v in vars(args).items()},
               "platform": platform.machine(), "threads": args.threads,
               "streams": {k: list(s.tokens.shape) for k, s in streams.items()},
               "target_seconds": {k: round(s.seconds, 1) for k, s in streams.items()},
               "results": results, "seconds": round(time.perf_counter() - t0, 1)}
    write_json_atomic(args.out, summary)
    print(f"wrote {args.out}")
    return summary


if __name__ == "__main__":
    main()
