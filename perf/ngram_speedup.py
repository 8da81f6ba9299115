"""Does the n-gram drafter pay where text repeats? dspark's NgramDrafter vs plain decoding, beside transformers'
own prompt lookup (`generate(prompt_lookup_num_tokens=k)`) vs its plain `generate`, on the same prompts.

Copy-heavy prompts: `--prompts` functions of held-out standard-library files (`dspark.models.corpus`), each in
the chat template as "Repeat this code exactly" with the answer's code fence opened, so the reply copies text
of the prompt. Mixed prompts: held-out windows continued as they are (little to copy). Every run stops at the
tokenizer's EOS (transformers' generate too), after at most the new-token count.
  B = 1    the copy-heavy queue on one slot, `--new-tokens` each: plain decoding (fixed-0) and fixed-k for every
           k in `--ks`, all in `lockstep` (interleaved step by step, each on its own decoder, thread CPU time),
           `--rounds` rounds; speed-up = the median over rounds of that round's steady tok/s ratio to plain.
           transformers: plain `generate` and `generate(prompt_lookup_num_tokens=k,
           max_matching_ngram_size=--n-max)` on the same prompts, one after another per round (order rotated),
           thread CPU time of the whole call (prefill included, as our queue's refills); the same medians.
           Reported side by side, and dspark's best speed-up over transformers' best (a ratio of ratios: the two
           loops' different overheads cancel).
  B = 4, 16  a queue of 2 x B requests, copy-heavy and mixed alternating, on B slots (continuous batching):
           plain, fixed-k for every k and adaptive-est (the planner on the online estimator's survival from the
           n-gram features, gamma = max k, with this machine's profiled step costs), in lockstep.
Every run is checked lossless: its tokens equal plain decoding's; at B = 1 they are compared with transformers'
greedy tokens too (a divergence must be a near tie of transformers' own logits, recorded with its gap).
Prints a table, writes perf/results/ngram_speedup.json.

    PYTHONPATH=. python perf/ngram_speedup.py [--model real|tiny] [--prompts 4] [--new-tokens 64] [--ks 2,4,6,8]
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from dspark.calibration.online import OnlineAcceptanceEstimator
from dspark.config import ScheduleConfig
from dspark.lab.profile import ProfileRuns, fit_cost_model, profile_points, profile_step_costs
from dspark.lab.timing import lockstep
from dspark.models.corpus import prompt_windows, stdlib_files
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.plan.planner import PlannerSettings, VerifyPlanner
from dspark.serve.config import EngineConfig
from dspark.serve.drafters.ngram import NgramDrafter
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import Adaptive, FixedK, Policy
from dspark.serve.policies.gate import GateSettings
from dspark.util.fileio import write_json_atomic
from dspark.util.options import at_least, int_list, output_path

TIE = 1e-3  # logits this close are a near tie: fp32 rounding of another attention kernel may flip the argmax
COPY_INSTRUCTION = "Repeat this code exactly:\n```python\n{code}\n```"


def progress(text: str) -> None:
    """One line on stderr: where a long run is."""
    print(text, file=sys.stderr, flush=True)


def functions(count: int, seed: int, min_lines: int = 6, max_lines: int = 14) -> list[str]:
    """`count` function blocks (a `def` line and the lines after it, `min_lines` to `max_lines` non-blank ones up
    to the next `def`), a seeded draw from every such block of the held-out standard-library files."""
    blocks = []
    for path in stdlib_files("heldout"):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        starts = [j for j, line in enumerate(lines) if line.lstrip().startswith("def ")] + [len(lines)]
        for j, nxt in zip(starts, starts[1:]):
            block = lines[j: min(nxt, j + max_lines)]
            if len([x for x in block if x.strip()]) >= min_lines:
                blocks.append(textwrap.dedent("\n".join(block)).rstrip())
    if len(blocks) < count:
        raise ValueError(f"only {len(blocks)} held-out functions have >= {min_lines} lines; ask fewer --prompts")
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))[:count]
    return [blocks[i] for i in order.tolist()]


def load(model: str, prompts: int, seed: int) -> tuple[TransformersCausalLM, list[list[int]], list[list[int]], int]:
    """(target, copy-heavy prompts, mixed-in continuation prompts as token ids, the EOS id every run stops at)."""
    if model == "real":
        from dspark.models import load_smollm2

        target, tok = load_smollm2()
        def chat(code: str) -> list[int]:
            text = tok.apply_chat_template([{"role": "user", "content": COPY_INSTRUCTION.format(code=code)}],
                                           tokenize=False, add_generation_prompt=True)
            return tok(text + "```python\n", add_special_tokens=False)["input_ids"]
        encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        windows = prompt_windows("heldout", encode, prompts, 48, seed).tolist()
        return target, [chat(code) for code in functions(prompts, seed)], windows, tok.eos_token_id
    root = str(Path(__file__).resolve().parents[1])  # the tests' tiny Llama: a smoke run
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.drafter_models import EOS, target_and_draft_lm

    gen = torch.Generator().manual_seed(seed)
    text = [torch.randint(3, 64, (12,), generator=gen).tolist() for _ in range(prompts)]
    return target_and_draft_lm()[0], [t + t[:3] for t in text], [t[:8] for t in text], EOS


def hf_speedups(target: TransformersCausalLM, prompts: list[list[int]], new_tokens: int, ks: Sequence[int],
                n_max: int, rounds: int, eos: int) -> tuple[dict, list[list[int]]]:
    """transformers' plain generate and prompt lookup per k over the prompts (stopping at `eos`), `rounds` rounds:
    tok/s per round per config and the median per-round speed-up over plain; and the plain greedy tokens."""
    names = ["plain"] + [f"lookup-{k}" for k in ks]
    tps: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, list[list[int]]] = {}
    with torch.no_grad(), target.own_attention() as model:
        def run(k: int | None) -> list[list[int]]:
            config = copy.deepcopy(model.generation_config)
            config.update(do_sample=False, max_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=eos,
                          temperature=None, top_p=None, top_k=None,
                          **({} if k is None else {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": n_max}))
            out = []
            for p in prompts:
                x = torch.tensor([p])
                out.append(model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)[
                    0, len(p):].tolist())
            return out
        run(None)  # warm-up
        for r in range(rounds):
            progress(f"transformers B = 1: round {r + 1}/{rounds}")
            for i in range(len(names)):
                name = names[(i + r) % len(names)]
                t0 = time.thread_time()
                outputs[name] = run(None if name == "plain" else int(name[7:]))
                tps[name].append(sum(map(len, outputs[name])) / (time.thread_time() - t0))
    for name in names:
        if outputs[name] != outputs["plain"]:
            raise AssertionError(f"transformers' {name} generate differs from its plain greedy generate")
    speedup = {n: statistics.median(a / b for a, b in zip(tps[n], tps["plain"])) for n in names}
    return {"tok_s": tps, "speedup": speedup}, outputs["plain"]


def transformers_agreement(target: TransformersCausalLM, prompts: list[list[int]], ours: list[list[int]],
                           theirs: list[list[int]]) -> dict:
    """Where dspark's greedy tokens and transformers' differ, the first position and transformers' top-2 logit gap
    there (the two attention implementations round differently: a near tie may go either way). AssertionError
    when a divergence is not a near tie (gap > TIE)."""
    out = []
    with torch.no_grad(), target.own_attention() as model:
        for i, (p, a, b) in enumerate(zip(prompts, ours, theirs)):
            if a == b:
                continue
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            logits = model(torch.tensor([p + b[:j]])).logits[0, -1].double()
            top = torch.topk(logits, 2).values
            gap = float(top[0] - top[1])
            out.append({"request": i, "position": j, "theirs": b[j] if j < len(b) else None,
                        "ours": a[j] if j < len(a) else None, "top2_gap": gap})
            if gap > TIE:
                raise AssertionError(f"dspark's greedy tokens differ from transformers' generate on request {i} at "
                                     f"token {j} where its top-2 logits are {gap:.2e} apart: {out[-1]}")
    return {"requests": len(prompts), "identical": len(prompts) - len(out), "near_tie_divergences": out}


def engine_speedups(decoder: SpecDecoder, prompts: list[list[int]], new_tokens: int,
                    policies: dict[str, Callable[[], Policy]], slots: int, rounds: int, eos: int) -> dict:
    """Every policy on the queue in lockstep (stopping at `eos`), `rounds` rounds: steady tok/s per round, the
    median per-round
    speed-up over plain (`fixed-0`), the median full-batch step seconds and the mean tokens committed per request
    per speculative step; lossless."""
    decoders = {name: decoder.fork() for name in policies}
    for name, make in policies.items():  # warm-up at this shape
        decoders[name].generate(prompts[:slots], 4, make(), max_batch=slots, stop_token_ids=[eos])
    tps: dict[str, list[float]] = {n: [] for n in policies}
    commit: dict[str, list[float]] = {n: [] for n in policies}
    step: dict[str, list[float]] = {n: [] for n in policies}  # median seconds of a full-batch step
    tokens = None
    names = list(policies)
    for r in range(rounds):
        progress(f"dspark B = {slots}: round {r + 1}/{rounds}")
        order = names[r % len(names):] + names[: r % len(names)]
        results = lockstep({n: decoders[n].start(prompts, new_tokens, policies[n](), max_batch=slots,
                                                 stop_token_ids=[eos]) for n in order})
        for name in names:
            res = results[name]
            got = [res.tokens[i, : int(c)].tolist() for i, c in enumerate(res.num_tokens)]
            tokens = got if tokens is None else tokens
            if got != tokens:
                raise AssertionError(f"losslessness violated: {name} at B = {slots} differs from plain decoding")
            done, seconds = res.steady()
            tps[name].append(done / seconds)
            step[name].append(statistics.median(s.times.total for s in res.steps if s.requests.numel() == slots))
            spec = [s for s in res.steps if s.speculated]
            commit[name].append(sum(float(s.commit_lens.sum()) for s in spec) / max(1, sum(s.requests.numel()
                                                                                           for s in spec)))
    speedup = {n: statistics.median(a / b for a, b in zip(tps[n], tps["fixed-0"])) for n in names}
    return {"tok_s": tps, "speedup": speedup, "step_seconds": {n: statistics.median(t) for n, t in step.items()},
            "commit_per_request_step": {n: statistics.mean(c) for n, c in commit.items()}, "tokens": tokens}


def adaptive_est(decoder: SpecDecoder, prompts: list[list[int]], gamma: int, slots: int, new_tokens: int
                 ) -> tuple[Callable[[], Policy], dict]:
    """A factory of adaptive-est policies for B = slots: this machine's step costs profiled on `decoder` (the
    n-gram drafter's own steps), one estimator shared by every run (as in a server); and the profile."""
    grid = profile_points([slots], gamma)
    samples, plain = profile_step_costs(decoder.fork(reserve_new_tokens=new_tokens), prompts, grid, gamma,
                                        runs=ProfileRuns(tokens=min(12, new_tokens), repeats=1))
    cost, fit, _ = fit_cost_model(samples, gamma, platform=f"{platform.machine()}-cpu")
    estimator = OnlineAcceptanceEstimator(gamma)

    def make() -> Policy:
        # greedy decoding at lag 0: the argmax over the live survival, as the demo plans
        planning = PlannerSettings(lag=0, num_slots=slots, live_argmax=True)
        planner = VerifyPlanner(ScheduleConfig(gamma=gamma), cost, planning, temperatures=None)
        return Adaptive(planner, plain.step_seconds, gate=GateSettings(cost_window=None), estimator=estimator)
    return make, {"samples": [[s.num_requests, s.rows, s.seconds] for s in samples], "plain": plain.to_dict(),
                  "fit_rms": fit.rms}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="real", choices=("real", "tiny"))
    ap.add_argument("--prompts", type=at_least(1), default=4, help="copy-heavy prompts at B = 1 (default 4)")
    ap.add_argument("--new-tokens", type=at_least(2), default=64, help="new tokens per request (default 64)")
    ap.add_argument("--batch-new-tokens", type=at_least(2), default=48, help="... at B > 1 (default 48)")
    ap.add_argument("--ks", type=int_list(1), default=(2, 4, 6, 8), help="fixed k / prompt-lookup tokens")
    ap.add_argument("--n-min", type=at_least(1), default=1)
    ap.add_argument("--n-max", type=at_least(1), default=4)
    ap.add_argument("--batch-sizes", type=int_list(2), default=(4, 16), help="batched sections (default 4,16)")
    ap.add_argument("--rounds", type=at_least(1), default=3, help="paired rounds per section (default 3)")
    ap.add_argument("--seed", type=at_least(0), default=0)
    ap.add_argument("--out", type=output_path(), default="perf/results/ngram_speedup.json")
    args = ap.parse_args(argv)
    if args.n_min > args.n_max:
        ap.error(f"--n-min {args.n_min} must be <= --n-max {args.n_max}")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the three sections, print the table, write the JSON; returns the summary."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    target, copy_prompts, windows, eos = load(args.model, max(args.prompts, max(args.batch_sizes)), args.seed)
    ks = sorted(set(args.ks))
    drafter = NgramDrafter(args.n_min, args.n_max)
    longest = max(map(len, copy_prompts + windows)) + max(args.new_tokens, args.batch_new_tokens) + max(ks) + 80
    decoder = SpecDecoder(target, drafter, config=EngineConfig(cache_tokens=max(args.batch_sizes) * longest, clock="thread"))
    fixed = {f"fixed-{k}": (lambda k=k: FixedK(k)) for k in [0] + ks}
    queue = copy_prompts[: args.prompts]
    one = engine_speedups(decoder, queue, args.new_tokens, fixed, 1, args.rounds, eos)
    hf, hf_tokens = hf_speedups(target, queue, args.new_tokens, ks, args.n_max, args.rounds, eos)
    agreement = transformers_agreement(target, queue, one["tokens"], hf_tokens)
    best = max(ks, key=lambda k: one["speedup"][f"fixed-{k}"])
    hf_best = max(ks, key=lambda k: hf["speedup"][f"lookup-{k}"])
    sections = {"B=1": {k: v for k, v in one.items() if k != "tokens"}}
    for b in args.batch_sizes:
        mixed = [p for pair in zip(copy_prompts, windows) for p in pair][: 2 * b]
        progress(f"dspark B = {b}: profiling step costs")
        make, profile = adaptive_est(decoder, mixed, max(ks), b, args.batch_new_tokens)
        res = engine_speedups(decoder, mixed, args.batch_new_tokens, {**fixed, "adaptive-est": make}, b, args.rounds,
                              eos)
        res.pop("tokens")
        best_b = max(ks, key=lambda k: res["speedup"][f"fixed-{k}"])
        sections[f"B={b}"] = {**res, "best_fixed": f"fixed-{best_b}", "profile": profile,
                              "adaptive_est_vs_best_fixed": res["speedup"]["adaptive-est"] / res["speedup"][
                                  f"fixed-{best_b}"]}
    given = sys.argv[1:] if argv is None else list(argv)
    summary = {
        "command": " ".join(["PYTHONPATH=. python perf/ngram_speedup.py", *given]),
        "model": args.model, "target": type(target.hf_model).__name__, "platform": platform.platform(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "clock": "thread",
        "config": vars(args) | {"ks": ks, "batch_sizes": list(args.batch_sizes)}, "drafter": repr(drafter),
        "prompt_tokens": [len(p) for p in queue], "new_tokens_b1": [len(t) for t in one["tokens"]],
        "eos": eos, "sections": sections, "transformers_b1": hf,
        "best_fixed_b1": f"fixed-{best}", "best_speedup_b1": one["speedup"][f"fixed-{best}"],
        "transformers_best": f"lookup-{hf_best}", "transformers_best_speedup": hf["speedup"][f"lookup-{hf_best}"],
        "ratio_of_ratios": one["speedup"][f"fixed-{best}"] / hf["speedup"][f"lookup-{hf_best}"],
        "lossless": True, "transformers_agreement": agreement, "seconds": time.perf_counter() - t_start,
    }
    print(format_table(summary))
    write_json_atomic(args.out, summary)
    print(f"wrote {args.out} in {summary['seconds']:.0f} s")
    return summary


def format_table(summary: dict) -> str:
    """Speed-ups over plain decoding per section and policy, and transformers' at B = 1."""
    lines = [f"{summary['target']} ({summary['model']}), {summary['drafter']}, thread clock, "
             f"{summary['config']['rounds']} lockstep rounds; speed-up = median per-round ratio to plain",
             "| B | policy | steady tok/s (median) | speed-up vs plain | step ms | tokens / request / spec. step |",
             "|---:|---|---:|---:|---:|---:|"]
    for name, sec in summary["sections"].items():
        for pol, tps in sec["tok_s"].items():
            commit = sec["commit_per_request_step"][pol]
            lines.append(f"| {name[2:]} | {pol} | {statistics.median(tps):.1f} | {sec['speedup'][pol]:.2f}x | "
                         f"{1000 * sec['step_seconds'][pol]:.1f} | {'-' if pol == 'fixed-0' else f'{commit:.2f}'} |")
    hf = summary["transformers_b1"]
    for cfg, tps in hf["tok_s"].items():
        lines.append(f"| 1 | transformers {cfg} | {statistics.median(tps):.1f} | {hf['speedup'][cfg]:.2f}x | | |")
    lines.append(f"B = 1: dspark {summary['best_fixed_b1']} {summary['best_speedup_b1']:.2f}x plain, transformers "
                 f"{summary['transformers_best']} {summary['transformers_best_speedup']:.2f}x its plain generate: "
                 f"ratio of ratios {summary['ratio_of_ratios']:.2f}")
    agree = summary["transformers_agreement"]
    lines.append(f"B = 1 greedy tokens identical to transformers' generate on {agree['identical']} of "
                 f"{agree['requests']} requests" + "".join(
                     f"; request {d['request']} from token {d['position']} (a near tie: top-2 logits "
                     f"{d['top2_gap']:.1e} apart)" for d in agree["near_tie_divergences"]))
    for name, sec in summary["sections"].items():
        if "adaptive_est_vs_best_fixed" in sec:
            lines.append(f"{name}: adaptive-est {sec['adaptive_est_vs_best_fixed']:.2f}x of the best fixed k "
                         f"({sec['best_fixed']}, {sec['speedup'][sec['best_fixed']]:.2f}x plain)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
