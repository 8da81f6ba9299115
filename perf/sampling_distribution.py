"""Is speculative sampling lossless on the real model? Committed-token distributions vs the exact target's.

`--drafter` picks what drafts: the shipped block draft (`block`), prompt lookup (`ngram`: deterministic
proposals, q one-hot) or a small causal LM (`causal-lm`: the target's first `--draft-layers` layers with its
embeddings, final norm and head, the same vocabulary and tokenizer); `--top-k` / `--top-p` warp the target and
the drafter alike, and the exact reference below is warped by transformers' own warpers.

For `--prompts` held-out prompts (chosen among `--candidates` windows: among those where the draft's greedy
first token is the target's, the ones whose first-token top-1 probability is closest to 0.5, so sampled drafts
are both accepted and rejected), the decode loop
samples `--samples` continuations of `--new-tokens` tokens per policy: fixed-k for every k in `--ks`
(speculative sampling: draft, compact verify, rejection sampling, bonus) and plain target sampling
(fixed-0), each as copies of the prompt batched `--chunk` per `SpecDecoder.generate(sampling=True)` call.

The reference is exact, by enumeration of the target's softmax at `--temperature` (transformers' own
attention, dense): p(t1) over the whole vocabulary, and for the top first tokens S (smallest set with mass
>= `--mass`, at most `--max-branch`) p(t2 | t1). Tested per prompt and policy, on
  position 1   t1 against p(t1);
  position 2   t2 of the samples with t1 in S against p(t2 | t1 in S) = sum_{t1 in S} p(t1) p(t2 | t1) / p(S);
  joint        (t1, t2) of those samples against p(t1, t2 | t1 in S),
with two statistics: total-variation distance and Pearson's chi-square over the categories expected >= 5
times (the rest pooled). Their null spread is a parametric bootstrap: `--bootstrap` sample sets of the same
size drawn from the exact distribution. A test passes when its bootstrap p-value is >= alpha / (number of
tests) (Bonferroni, alpha `--alpha`); plain sampling is the control that shows the test's own false-alarm
behaviour. Prints a table, writes perf/results/sampling_distribution.json.

    PYTHONPATH=. python perf/sampling_distribution.py [--model real|tiny] [--samples 768] [--ks 1,3,6]
"""
from __future__ import annotations

import argparse
import copy
import math
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor

from dspark.models.corpus import prompt_windows
from dspark.models.draft import DraftModel
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve.config import EngineConfig, SamplingParams
from dspark.serve.drafters.causal_lm import CausalLMDrafter
from dspark.serve.drafters.ngram import NgramDrafter
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import FixedK
from dspark.util.fileio import write_json_atomic
from dspark.util.options import POSITIVE_REAL, at_least, output_path, real

MIN_EXPECTED = 5.0   # chi-square: categories expected fewer times are pooled into one bin
PAGE_SIZE = 16
# the tiny random Llama's next-token distribution is a point mass at T = 1 (top-1 > 0.999 on every prompt);
# at 12 its top-1 is about 0.5 and drafts are accepted ~40 % of the time, so both accept paths are tested
DEFAULT_TEMPERATURE = {"real": 1.0, "tiny": 12.0}
Models = tuple[TransformersCausalLM, DraftModel, Callable[[str], list] | None]


def drafter_for(name: str, target: TransformersCausalLM, draft: DraftModel, layers: int) -> object:
    """The drafter `--drafter` names: the block draft, an NgramDrafter, or a CausalLMDrafter over the target's
    first `layers` layers (its own weights, copied: the target is untouched)."""
    if name == "block":
        return draft
    if name == "ngram":
        return NgramDrafter(1, 3)
    hf = target.hf_model
    if not 1 <= layers < hf.config.num_hidden_layers:
        raise SystemExit(f"--draft-layers must be in [1, {hf.config.num_hidden_layers - 1}], got {layers}")
    config = copy.deepcopy(hf.config)
    config.num_hidden_layers = layers
    small = type(hf)(config).to(hf.dtype).eval()
    small.load_state_dict({k: v for k, v in hf.state_dict().items() if not k.startswith("model.layers.")
                           or int(k.split(".")[2]) < layers})
    return CausalLMDrafter(small)


def warp(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None) -> Tensor:
    """transformers' own sampling warpers, in generate's order (the reference the engine's warp must match)."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else []) + (
        [TopPLogitsWarper(top_p)] if top_p else [])
    return LogitsProcessorList(warpers)(None, logits)


def load(model: str, gamma: int) -> Models:
    """(target, draft, encoder or None): SmolLM2 + its shipped draft (`real`), or the tests' tiny Llama and a
    draft distilled on it for a second (`tiny`, gamma drafts)."""
    if model == "real":
        from dspark.lab.demo.models import load_models

        return load_models(torch.device("cpu"))
    if model == "tiny":
        _repo_on_path()
        from tests.engine_models import tiny_models

        target, draft = tiny_models(gamma=gamma)
        return target, draft, None
    raise ValueError(f"--model must be real or tiny, got {model!r}")


def _repo_on_path() -> None:
    """The repository root on sys.path, for `tests.engine_models` when run as `python perf/<script>.py`."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)


@torch.no_grad()
def next_token_probs(target: TransformersCausalLM, seqs: Tensor, temperature: float, batch: int = 64,
                     top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """[n, V] float64 warped probabilities (temperature, top-k, top-p: `warp`) of the token after each row of
    `seqs` [n, L] (dense forward with the model's own attention, in batches)."""
    out = []
    with target.own_attention() as model:
        for i in range(0, seqs.shape[0], batch):
            x = seqs[i: i + batch]
            logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[:, -1]
            out.append(torch.softmax(warp(logits.double(), temperature, top_k, top_p), -1))
    return torch.cat(out)


def choose_prompts(decoder: SpecDecoder, candidates: Tensor, count: int, temperature: float,
                   top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """The `count` candidates whose first-token top-1 probability is closest to 0.5 among those where the
    draft's greedy first token is the target's (one greedy fixed-1 step over all candidates): there the draft
    puts its mass where the target does, so sampled drafts are both accepted and rejected. Candidates without
    that agreement come last (used only when too few agree)."""
    top = next_token_probs(decoder.target, candidates, temperature, top_k=top_k, top_p=top_p).max(-1).values
    res = decoder.generate(candidates, 1, FixedK(1), mode="compact")
    agree = (res.steps[0].correct_lens >= 1).cpu()
    return candidates[((top - 0.5).abs() + (~agree).double()).argsort()[:count]]


def exact_reference(target: TransformersCausalLM, prompt: Tensor, temperature: float, mass: float,
                    max_branch: int, top_k: int | None = None, top_p: float | None = None) -> dict:
    """p1 [V]; branch S [s] (top first tokens, mass >= `mass` or `max_branch` of them); p2 [s, V] = p(t2 | t1),
    all warped."""
    p1 = next_token_probs(target, prompt[None], temperature, top_k=top_k, top_p=top_p)[0]
    order = p1.argsort(descending=True)
    size = min(int((p1[order].cumsum(0) < mass).sum()) + 1, max_branch, p1.numel())
    branch = order[:size]
    seqs = torch.cat([prompt[None].expand(size, -1), branch[:, None]], 1)
    return {"p1": p1, "branch": branch, "p2": next_token_probs(target, seqs, temperature, top_k=top_k, top_p=top_p)}


def sample_runs(decoder: SpecDecoder, prompt: Tensor, k: int, samples: int, chunk: int, new_tokens: int,
                temperature: float, seed: int, top_k: int | None = None, top_p: float | None = None
                ) -> tuple[Tensor, dict]:
    """[samples, new_tokens] committed tokens of `samples` copies of `prompt` under fixed-k sampling (compact
    mode), `chunk` copies per generate call; and what the first step did (draft-1 acceptance)."""
    tokens, accepted, seconds = [], [], 0.0
    for i, start in enumerate(range(0, samples, chunk)):
        n = min(chunk, samples - start)
        res = decoder.generate(prompt[None].expand(n, -1).contiguous(), new_tokens, FixedK(k), mode="compact",
                               sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + i))
        tokens.append(res.tokens[:, :new_tokens].cpu())
        if k:
            accepted.append((res.steps[0].correct_lens >= 1).float().cpu())
        seconds += res.seconds
    stats = {"decode_seconds": seconds}
    if accepted:
        stats["first_draft_accept_rate"] = float(torch.cat(accepted).mean())
    return torch.cat(tokens), stats


def _statistics(idx: Tensor, rep: Tensor, reps: int, n: int, probs: Tensor, binned: Tensor) -> tuple[Tensor, Tensor]:
    """(TV [reps], chi-square [reps]) of `reps` sample sets of size n: category ids `idx` of the sample set `rep`.

    TV = 1/2 sum_c |count_c / n - p_c| (unsampled categories contribute p_c); chi-square over the `binned`
    category ids (sorted) plus one pooled bin for every other category."""
    keys, counts = torch.unique(rep * probs.numel() + idx, return_counts=True)
    krep, kcat = keys // probs.numel(), keys % probs.numel()
    p = probs[kcat]
    tv = 0.5 * (1 + torch.zeros(reps, dtype=torch.float64).index_add_(0, krep, (counts / n - p).abs() - p))
    pos = torch.searchsorted(binned, kcat).clamp(max=max(binned.numel() - 1, 0))
    hit = binned[pos] == kcat if binned.numel() else torch.zeros_like(kcat, dtype=torch.bool)
    bins = binned.numel() + 1
    bin_id = torch.where(hit, pos, torch.full_like(pos, binned.numel()))
    observed = torch.zeros(reps * bins, dtype=torch.float64).index_add_(0, krep * bins + bin_id, counts.double())
    expected = torch.cat([probs[binned], (1 - probs[binned].sum()).clamp(min=0)[None]]) * n
    keep = expected > 0
    observed = observed.reshape(reps, bins)[:, keep]
    chi2 = ((observed - expected[keep]) ** 2 / expected[keep]).sum(1)
    return tv, chi2


def distribution_test(observed: Tensor, probs: Tensor, bootstrap: int, gen: torch.Generator) -> dict:
    """TV and chi-square of the observed category ids [n] against `probs` (flat, sums to ~1), each with its
    bootstrap null (sets of n drawn from `probs`): mean, 99th percentile and the p-value P(null >= observed)."""
    n = observed.numel()
    if n == 0:
        raise ValueError("no samples to test (every sample fell outside the enumerated branch)")
    probs = probs / probs.sum()
    binned = (probs * n >= MIN_EXPECTED).nonzero().squeeze(1)
    cdf = probs.cumsum(0)
    null_idx = torch.searchsorted(cdf, torch.rand(bootstrap, n, generator=gen, dtype=torch.float64) * cdf[-1])
    null_idx = null_idx.clamp(max=probs.numel() - 1)
    reps = torch.arange(bootstrap).repeat_interleave(n)
    null_tv, null_chi2 = _statistics(null_idx.flatten(), reps, bootstrap, n, probs, binned)
    obs_tv, obs_chi2 = _statistics(observed, torch.zeros(n, dtype=torch.int64), 1, n, probs, binned)
    out = {"n": n, "chi2_bins": int(binned.numel()) + 1}
    for name, obs, null in (("tv", obs_tv, null_tv), ("chi2", obs_chi2, null_chi2)):
        out[name] = {"observed": float(obs[0]), "null_mean": float(null.mean()),
                     "null_p99": float(null.quantile(0.99)),
                     "p_value": (1 + int((null >= obs[0]).sum())) / (1 + bootstrap)}
    return out


def check_samples(tokens: Tensor, ref: dict, bootstrap: int, gen: torch.Generator) -> dict:
    """Position 1, position 2 given t1 in the branch, and the joint (t1, t2) given t1 in the branch."""
    p1, branch, p2 = ref["p1"], ref["branch"], ref["p2"]
    vocab = p1.numel()
    where = torch.full((vocab,), -1, dtype=torch.int64)
    where[branch] = torch.arange(branch.numel())
    t1, out = tokens[:, 0], {}
    out["position 1"] = distribution_test(t1, p1, bootstrap, gen)
    if tokens.shape[1] > 1:
        b = where[t1]
        inside = b >= 0
        w = p1[branch] / p1[branch].sum()
        out["position 2"] = distribution_test(tokens[inside, 1], (w[:, None] * p2).sum(0), bootstrap, gen)
        out["joint 1-2"] = distribution_test(b[inside] * vocab + tokens[inside, 1], (w[:, None] * p2).flatten(),
                                             bootstrap, gen)
        out["position 2"]["kept_share"] = float(inside.float().mean())
        out["joint 1-2"]["kept_share"] = out["position 2"]["kept_share"]
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="real", choices=("real", "tiny"))
    ap.add_argument("--drafter", default="block", choices=("block", "ngram", "causal-lm"))
    ap.add_argument("--draft-layers", type=at_least(1), default=6,
                    help="causal-lm: the target's first layers that make the drafter (default 6)")
    ap.add_argument("--top-k", type=at_least(1), default=None, help="sample among the k most likely tokens")
    ap.add_argument("--top-p", type=real(0.0, 1.0, low_open=True), default=None, help="sample within the nucleus")
    ap.add_argument("--ks", default="1,3,6", help="fixed-k policies (speculative sampling); plain always runs")
    ap.add_argument("--samples", type=at_least(1), default=768, help="sampled continuations per prompt and policy")
    ap.add_argument("--chunk", type=at_least(1), default=256, help="prompt copies per generate call")
    ap.add_argument("--new-tokens", type=at_least(1), default=2)
    ap.add_argument("--prompts", type=at_least(1), default=1)
    ap.add_argument("--candidates", type=at_least(1), default=32, help="held-out windows the prompts are chosen from")
    ap.add_argument("--prompt-len", type=at_least(1), default=8, help="prompt tokens (each sample prefills them)")
    ap.add_argument("--temperature", type=POSITIVE_REAL, default=None,
                    help=f"sampling temperature (default {DEFAULT_TEMPERATURE['real']} real, "
                         f"{DEFAULT_TEMPERATURE['tiny']} tiny: the tiny random target is a point mass at 1)")
    ap.add_argument("--mass", type=real(0.0, 1.0, low_open=True), default=0.995, help="first-token mass enumerated for position 2")
    ap.add_argument("--max-branch", type=at_least(1), default=256, help="at most this many first tokens enumerated")
    ap.add_argument("--bootstrap", type=at_least(1), default=2000,
                    help="null sample sets per test (raised to 4 x tests / alpha when below)")
    ap.add_argument("--alpha", type=real(0.0, 1.0, low_open=True, high_open=True), default=0.05, help="family-wise false-alarm rate (Bonferroni)")
    ap.add_argument("--seed", type=at_least(0), default=0)
    ap.add_argument("--out", type=output_path(), default="perf/results/sampling_distribution.json")
    args = ap.parse_args(argv)
    if args.temperature is None:
        args.temperature = DEFAULT_TEMPERATURE[args.model]
    try:
        args.k_list = sorted({int(x) for x in args.ks.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--ks must be comma-separated ints, got {args.ks!r}") from None
    if not args.k_list or min(args.k_list) < 1:
        raise SystemExit(f"--ks must be ints >= 1 (plain sampling always runs), got {args.ks!r}")
    if args.new_tokens > 3:
        raise SystemExit(f"--new-tokens must be 1-3 (positions 1 and 2 are tested), got {args.new_tokens}")
    if args.prompt_len < 3 or args.candidates < args.prompts:
        raise SystemExit(f"--prompt-len must be >= 3 and --candidates >= --prompts, got {args.prompt_len}, "
                         f"{args.candidates}, {args.prompts}")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Run every policy on every chosen prompt, test, print the table, write the JSON; returns the summary."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    target, draft, encode = load(args.model, max(args.k_list))
    if args.drafter == "block" and max(args.k_list) > draft.gamma:
        raise SystemExit(f"--ks {args.ks}: the draft proposes at most gamma = {draft.gamma} tokens")
    gen = torch.Generator().manual_seed(args.seed)
    if encode is not None:
        candidates = prompt_windows("heldout", encode, args.candidates, args.prompt_len, args.seed)
    else:
        candidates = torch.randint(3, target.geometry.vocab_size, (args.candidates, args.prompt_len), generator=gen)
    width = max(args.k_list) + 1
    per_request = -(-(args.prompt_len + args.new_tokens + width) // PAGE_SIZE) * PAGE_SIZE
    batch = max(min(args.chunk, args.samples), args.candidates)
    decoder = SpecDecoder(target, drafter_for(args.drafter, target, draft, args.draft_layers),
                          config=EngineConfig(cache_tokens=batch * per_request))
    prompts = choose_prompts(decoder, candidates, args.prompts, args.temperature, args.top_k, args.top_p)
    policies = [("plain", 0)] + [(f"fixed-{k}", k) for k in args.k_list]
    num_tests = 2 * len(policies) * len(prompts) * (3 if args.new_tokens > 1 else 1)  # TV + chi2 per tested set
    threshold = args.alpha / num_tests
    # the smallest bootstrap p-value, 1 / (bootstrap + 1), must lie well below the threshold or no test can fail
    bootstrap = max(args.bootstrap, math.ceil(4 / threshold))
    runs = []
    for i, prompt in enumerate(prompts):
        ref = exact_reference(target, prompt, args.temperature, args.mass, args.max_branch, args.top_k, args.top_p)
        info = {"prompt": i, "prompt_ids": prompt.tolist(), "p1_top": float(ref["p1"].max()),
                "p1_entropy_nats": float(-(ref["p1"] * ref["p1"].clamp(min=1e-300).log()).sum()),
                "branch_size": int(ref["branch"].numel()), "branch_mass": float(ref["p1"][ref["branch"]].sum())}
        for j, (name, k) in enumerate(policies):
            tokens, stats = sample_runs(decoder, prompt, k, args.samples, args.chunk, args.new_tokens,
                                        args.temperature, args.seed + 1000 * (i * len(policies) + j), args.top_k,
                                        args.top_p)
            runs.append({**info, "policy": name, **stats, "tests": check_samples(tokens, ref, bootstrap, gen)})
    for r in runs:
        for t in r["tests"].values():
            t["passes"] = min(t["tv"]["p_value"], t["chi2"]["p_value"]) >= threshold
    speculative = [t["passes"] for r in runs if r["policy"] != "plain" for t in r["tests"].values()]
    control = [t["passes"] for r in runs if r["policy"] == "plain" for t in r["tests"].values()]
    given = sys.argv[1:] if argv is None else list(argv)
    summary = {
        "command": " ".join(["PYTHONPATH=. python perf/sampling_distribution.py", *given]),
        "model": args.model, "target": type(target.hf_model).__name__, "vocab": target.geometry.vocab_size,
        "platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "config": {k: v for k, v in vars(args).items() if k not in ("k_list",)},
        "mode": "compact", "bootstrap": bootstrap, "alpha": args.alpha, "num_tests": num_tests,
        "p_value_threshold": threshold, "runs": runs,
        "lossless": all(speculative), "plain_control_passes": all(control),
        "seconds": time.perf_counter() - t_start,
    }
    print(format_table(summary))
    write_json_atomic(args.out, summary)
    print(f"wrote {args.out} in {summary['seconds']:.0f} s")
    return summary


def format_table(summary: dict) -> str:
    """One line per (prompt, policy, tested position)."""
    c = summary["config"]
    lines = [f"{summary['target']} ({summary['model']}, vocab {summary['vocab']}), drafter {c['drafter']}, "
             f"T = {c['temperature']}, top-k {c['top_k']}, top-p {c['top_p']}, "
             f"{c['samples']} samples per policy, compact mode, {summary['bootstrap']} bootstrap sets",
             "| prompt | policy | tested | n | TV | TV null p99 | TV p | chi2 (bins) | chi2 null p99 | chi2 p | pass |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in summary["runs"]:
        for name, t in r["tests"].items():
            lines.append(f"| {r['prompt']} | {r['policy']} | {name} | {t['n']} | {t['tv']['observed']:.4f} | "
                         f"{t['tv']['null_p99']:.4f} | {t['tv']['p_value']:.4f} | "
                         f"{t['chi2']['observed']:.1f} ({t['chi2_bins']}) | {t['chi2']['null_p99']:.1f} | "
                         f"{t['chi2']['p_value']:.4f} | {'yes' if t['passes'] else 'NO'} |")
    for r in summary["runs"]:
        if r["policy"] == "plain":
            lines.append(f"prompt {r['prompt']}: p(t1) top-1 {r['p1_top']:.3f}, entropy "
                         f"{r['p1_entropy_nats']:.2f} nats; position 2 enumerates {r['branch_size']} first tokens "
                         f"({100 * r['branch_mass']:.2f} % mass)")
        elif "first_draft_accept_rate" in r:
            lines.append(f"prompt {r['prompt']} {r['policy']}: first draft accepted in "
                         f"{100 * r['first_draft_accept_rate']:.1f} % of first steps")
    lines.append(f"each test passes at bootstrap p >= {summary['p_value_threshold']:.2g} (alpha {summary['alpha']} / "
                 f"{summary['num_tests']} tests): speculative sampling "
                 f"{'LOSSLESS (no test rejects)' if summary['lossless'] else 'REJECTED by some test'}; plain control "
                 f"{'passes' if summary['plain_control_passes'] else 'FAILS'}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
