"""Record a policy-lab trace (`dspark.lab.replay.trace`) teacher-forced: about twice the cost of generating the text.

1. Greedy continuations, N_i + gamma tokens per request, by the engine itself: `SpecDecoder` with FixedK(0)
   (target-only greedy steps), continuous batching over `max_batch` requests. With `eos_token_id`, N_i is cut after the
   first eos among the first N_i tokens (where a server stops; the continuation still holds gamma more).
2. One target forward per request (transformers' own sdpa attention) over the prompt and the continuation
   but its last token: the final-normed hidden states and the logits at every continuation position. The
   argmax there is checked against the decoded continuation (mismatches are counted in `meta`), the top-1
   minus top-2 logit is `target_margin`, the softmax is the soft proxy's p.
3. The draft over the whole sequence (`DraftModel.forward_dense`) with the target's hidden states as the
   decode loop feeds them (row r reads h_{r-1}, zeros at row 0), then its block chain at every root
   P_i - 1 + t at once: the drafts (the chain's argmax), the head's confidence logits (anchor: the root
   token) and `draft_features` of the chain's draft-vocabulary logits (the online estimator's input).
What the live decode loop computes at a step of request i at position t agrees with row t up to float
rounding (the live loop runs the paged ragged attention; tests compare them step by step).

`python -m dspark.lab.replay.record --out PATH --requests 512 --seed 0` records the default workload with
SmolLM2-135M-Instruct and the shipped draft; the shipped trace's manifest names its command and time. The
same command, max_batch and thread count on the same machine and torch build write the same file bit for bit.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark.calibration.online import draft_features
from dspark.lab.progress import StageProgress
from dspark.lab.replay.trace import DEFAULT_TRACE, RECORD, Trace, save_trace
from dspark.lab.replay.workload import KINDS, Request, WorkloadSpec, build_workload
from dspark.models.draft import DEFAULT_WEIGHTS, DraftModel, file_sha256, target_identity
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve.checks import check_device
from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import FixedK
from dspark.util.options import at_least, output_path, usable_device
from dspark.util.validate import check_int, check_sha256, check_type

Progress = Callable[[str, int, int], None]  # (stage, done, total), as `StageProgress` prints it
SHOWN_MISMATCHES = 8  # (request, position) pairs of argmax mismatches kept in meta


def _check_requests(requests: Sequence[Request], gamma: int, max_seq_len: int) -> None:
    if not requests:
        raise ValueError("requests must hold at least one Request")
    for i, r in enumerate(requests):
        check_type(f"requests[{i}]", r, Request)
        if r.prompt.dim() != 1 or r.prompt.dtype != torch.int64 or r.prompt.numel() < 3:
            raise ValueError(f"requests[{i}].prompt must be int64 [P >= 3], got {r.prompt.dtype} "
                             f"{list(r.prompt.shape)}")
        check_int(f"requests[{i}].max_new_tokens", r.max_new_tokens, 1)
        if r.prompt.numel() + r.max_new_tokens + gamma + 1 > max_seq_len:
            raise ValueError(f"requests[{i}]: prompt {r.prompt.numel()} + max_new_tokens {r.max_new_tokens} + "
                             f"gamma + 1 = {gamma + 1} exceeds max_seq_len {max_seq_len}")


@torch.no_grad()
def greedy_continuations(decoder: SpecDecoder, requests: Sequence[Request], width: int, max_batch: int,
                         progress: Progress | None = None) -> list[Tensor]:
    """Each request's first max_new_tokens + width greedy tokens ([N_i + width] int64, CPU) by target-only
    decoding: one continuously batched run over every request, the longest admitted first (a short drain
    tail). progress("greedy", tokens done, tokens) after each step."""
    order = sorted(range(len(requests)), key=lambda i: -requests[i].max_new_tokens)
    counts = torch.tensor([requests[i].max_new_tokens + width for i in order], dtype=torch.int64)
    run = decoder.start([requests[i].prompt for i in order], counts, FixedK(0), max_batch=min(max_batch, len(order)))
    done, total = 0, int(counts.sum())
    while True:
        try:
            step = next(run).useful
        except StopIteration as stop:
            tokens = stop.value.tokens
            break
        for unit in range(done + 1, done + step + 1) if progress is not None else ():
            progress("greedy", unit, total)  # one call per token: StageProgress counts units one at a time
        done += step
    out: list[Tensor] = [torch.empty(0)] * len(requests)
    for row, i in enumerate(order):
        out[i] = tokens[row, : int(counts[row])].cpu()
    return out


@torch.no_grad()
def teacher_forced(target: TransformersCausalLM, draft: DraftModel, prompt: Tensor, continuation: Tensor,
                   gamma: int) -> dict[str, Tensor]:
    """One request's trace rows from its prompt [P] and greedy continuation [N + gamma]: drafts,
    confidence_logits, soft [N, gamma], features [N, gamma, 3], accepted [N], target_margin [N + gamma] and
    the target's argmax [N + gamma] at every continuation position (all on the CPU; soft and target_margin
    rounded to float16, as the trace file stores them)."""
    p, n = prompt.numel(), continuation.numel() - gamma
    device = target.hf_model.device
    x = torch.cat([prompt, continuation[:-1]]).to(device)  # [P + N + gamma - 1]
    with target.own_attention() as hf:
        hidden = hf.base_model(input_ids=x[None], use_cache=False).last_hidden_state[0]
    logits = target.logits(hidden[p - 1:]).float()  # [N + gamma, V]: row c predicts continuation[c]
    top2 = logits.topk(2, dim=-1).values
    feats = F.pad(hidden[: p + n - 2], (0, 0, 1, 0))  # row r holds h_{r-1}; zeros at row 0
    roots = draft.forward_dense(x[None, : p + n - 1], feats[None])[0, p - 1:]  # [N, d]: root at P - 1 + t
    hk, reduced = draft.chain(roots, gamma)
    drafts = draft.vocab_ids[reduced.argmax(-1)]
    truth = continuation.to(device).unfold(0, gamma, 1)[:n]  # [N, gamma]: continuation[t + j]
    p_target = torch.softmax(logits, -1)[:, draft.vocab_ids].unfold(0, gamma, 1)[:n].transpose(1, 2)
    rows = {"drafts": drafts, "confidence_logits": draft.confidence_logits(hk, x[p - 1: p - 1 + n], drafts, reduced),
            "features": draft_features(reduced),
            "accepted": torch.cumprod((drafts == truth).to(torch.int64), dim=1).sum(1),
            "soft": torch.minimum(p_target, torch.softmax(reduced.float(), -1)).sum(-1).half().float(),
            "target_margin": (top2[:, 0] - top2[:, 1]).half().float(), "argmax": logits.argmax(-1)}
    return {k: v.cpu() for k, v in rows.items()}


@dataclass(frozen=True)
class RecordSettings:
    """How `record_trace` decodes.

    Args:
        gamma: drafts per block (None: the draft's full block).
        eos_token_id: cut each N_i after its first eos (None: no cut).
        max_batch: requests decoded at once.
        device: where the models run (`cpu` or `cuda`; a torch.device once checked).
    """

    gamma: int | None = None
    eos_token_id: int | None = None
    max_batch: int = 32
    device: str | torch.device = "cpu"

    def __post_init__(self) -> None:
        if self.gamma is not None:
            check_int("gamma", self.gamma, 1)
        check_type("eos_token_id", self.eos_token_id, int, optional=True)
        check_int("max_batch", self.max_batch, 1)
        object.__setattr__(self, "device", check_device(self.device))


def record_trace(target: TransformersCausalLM, draft: DraftModel, requests: Sequence[Request], *,
                 draft_sha256: str, settings: RecordSettings = RecordSettings(), meta: dict | None = None,
                 progress: Progress | None = None) -> Trace:
    """The trace of `requests` (kinds, prompts, max_new_tokens) under `target` and `draft`.

    draft_sha256: the sha256 of the draft's weights file (what `load_trace` matches). settings: gamma, the eos cut,
    max_batch and device (`RecordSettings`). meta: entries added to the trace's meta (workload, seed, command).
    progress: called (stage, done, total) as the stages "greedy" (tokens) and "teacher" (requests) advance."""
    check_type("target", target, TransformersCausalLM)
    check_type("draft", draft, DraftModel)
    check_type("settings", settings, RecordSettings)
    check_sha256("draft_sha256", draft_sha256)
    gamma = draft.gamma if settings.gamma is None else settings.gamma
    if gamma > draft.gamma:
        raise ValueError(f"gamma={gamma} exceeds the draft's block of {draft.gamma}")
    eos_token_id, max_batch, device = settings.eos_token_id, settings.max_batch, settings.device
    requests = list(requests)
    _check_requests(requests, gamma, min(target.geometry.max_seq_len, draft.cfg.max_seq_len))
    kinds = tuple(sorted({r.kind for r in requests}, key=lambda k: (KINDS.index(k) if k in KINDS else len(KINDS), k)))
    t0 = time.perf_counter()
    longest = max(r.prompt.numel() for r in requests) + max(r.max_new_tokens for r in requests) + gamma + 1
    config = EngineConfig(cache_tokens=min(max_batch, len(requests)) * (longest + 16), device=device)
    decoder = SpecDecoder(target, draft, config)
    generated = greedy_continuations(decoder, requests, gamma, max_batch, progress)
    t1 = time.perf_counter()
    parts: dict[str, list[Tensor]] = {}
    mismatches: list[list[int]] = []
    new_tokens = []
    for i, (r, gen) in enumerate(zip(requests, generated)):
        n = r.max_new_tokens
        if eos_token_id is not None and bool((gen[:n] == eos_token_id).any()):
            n = int((gen[:n] == eos_token_id).nonzero()[0]) + 1
        rows = teacher_forced(decoder.target, decoder.draft, r.prompt, gen[: n + gamma], gamma)
        mismatches += [[i, int(c)] for c in (rows.pop("argmax") != gen[: n + gamma]).nonzero().flatten()]
        for k, v in rows.items():
            parts.setdefault(k, []).append(v)
        new_tokens.append(n)
        parts.setdefault("continuation", []).append(gen[: n + gamma])
        if progress is not None:
            progress("teacher", i + 1, len(requests))
    t2 = time.perf_counter()
    zero = torch.zeros(1, dtype=torch.int64)
    facts = {"target": target_identity(target), "draft_sha256": draft_sha256, "draft_config": draft.cfg.to_dict(),
             "eos_token_id": eos_token_id, "eos_cut_requests": sum(n < r.max_new_tokens for n, r in
                                                                   zip(new_tokens, requests)),
             "argmax_mismatches": {"count": len(mismatches), "first": mismatches[:SHOWN_MISMATCHES]},
             "seconds": {"greedy": round(t1 - t0, 1), "teacher_forced": round(t2 - t1, 1),
                         "total": round(t2 - t0, 1)},
             "threads": torch.get_num_threads(), "device": str(decoder.device), "dspark": _version(),
             "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform()}
    return Trace(gamma=gamma, vocab_size=target.geometry.vocab_size, kinds=kinds,
                 kind_ids=torch.tensor([kinds.index(r.kind) for r in requests]),
                 prompt_offsets=torch.cat([zero, torch.tensor([r.prompt.numel() for r in requests]).cumsum(0)]),
                 prompt_tokens=torch.cat([r.prompt for r in requests]),
                 position_offsets=torch.cat([zero, torch.tensor(new_tokens).cumsum(0)]),
                 meta={**facts, **(meta or {})},
                 **{k: torch.cat(v) for k, v in parts.items()})


def _version() -> str:
    from dspark import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: record the default workload with SmolLM2 and the shipped draft, write the trace."""
    parser = argparse.ArgumentParser(prog=RECORD, description="Record a policy-lab trace: the default workload "
                                     "(code / chat / copy requests from held-out text) with SmolLM2-135M-Instruct "
                                     "and the shipped draft.")
    parser.add_argument("--out", type=output_path(), default=str(DEFAULT_TRACE), help="the .safetensors file "
                        "(its .json manifest is written beside it)")
    parser.add_argument("--requests", type=at_least(len(KINDS)), default=512)
    parser.add_argument("--seed", type=at_least(0), default=0, help="seeds the workload (prompts, kinds, lengths)")
    parser.add_argument("--max-batch", type=at_least(1), default=64, help="requests decoded at once")
    parser.add_argument("--threads", type=at_least(1), default=1, help="torch intra-op threads")
    parser.add_argument("--device", type=usable_device, default="cpu")
    args = parser.parse_args(argv)
    if not str(args.out).endswith(".safetensors"):
        parser.error(f"argument --out: must name a .safetensors file, got {args.out!r}")
    torch.set_num_threads(args.threads)
    from transformers.utils import logging

    from dspark.models import load_smollm2
    from dspark.models.draft import load_draft

    logging.disable_progress_bar()  # the GGUF reader's carriage-return bar would wall a log file
    with contextlib.nullcontext() if sys.stderr.isatty() else contextlib.redirect_stderr(io.StringIO()):
        target, tokenizer = load_smollm2()
    draft = load_draft(target)
    spec = WorkloadSpec(requests=args.requests, seed=args.seed)
    requests = build_workload(tokenizer, spec)
    command = f"{RECORD} --out {args.out} --requests {args.requests} --seed {args.seed}"
    settings = RecordSettings(eos_token_id=tokenizer.eos_token_id, max_batch=args.max_batch, device=args.device)
    trace = record_trace(target, draft, requests, draft_sha256=file_sha256(DEFAULT_WEIGHTS), settings=settings,
                         meta={"workload": spec.to_dict(), "seed": args.seed, "command": command},
                         progress=StageProgress(lines=20))
    manifest = save_trace(trace, args.out)
    print(f"{'kind':<6} {'requests':>8} {'mean N':>7} {'mean P':>7} {'mean a(t)':>9} {'P(a>=1)':>8}")
    for kind, s in manifest["summary"].items():
        print(f"{kind:<6} {s['requests']:>8} {s['mean_new_tokens']:>7.1f} {s['mean_prompt_len']:>7.1f} "
              f"{s['mean_accepted']:>9.3f} {s['p_accept_ge1']:>8.3f}")
    print(f"wrote {args.out} ({manifest['bytes'] / 1e6:.1f} MB, sha256 {manifest['sha256'][:12]}) in "
          f"{trace.meta['seconds']['total']:.0f} s; argmax mismatches {trace.meta['argmax_mismatches']['count']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
