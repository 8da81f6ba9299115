"""The live engine: a target + a drafter over their paged KV caches, serving a queue with one policy.

`SpecDecoder` wires a `LiveTarget` (transformers' own model code over dspark's paged KV cache) and a
`Drafter` (the block draft, `BlockDrafter`: it reads the target's final hidden state one position back; the
n-gram `NgramDrafter`; a small causal LM, `CausalLMDrafter`) into the shared run loop,
`dspark.engine.step.serve`. Host syncs per step, counted in the telemetry: the verify lengths (to build the
layout) and the commit lengths (next positions, stop test); a target-only step needs only the second.
"""
from __future__ import annotations

import copy
import itertools
import time
from typing import Any, Sequence

import torch
from torch import Tensor

from dspark.config import VerifyMode
from dspark.engine.batch import Batch, Scheduler
from dspark.engine.checks import (
    Prompts,
    check_device,
    check_new_tokens,
    check_positive_or_none,
    check_prompts,
    check_fits,
    check_seq_len,
    check_stop_ids,
)
from dspark.engine.drafter import BlockDrafter, Drafter, model_cache
from dspark.engine.policies import Policy
from dspark.engine.results import DecodeRun, GenerateResult, finish
from dspark.engine.sampling import Sampling
from dspark.engine.step import Engine, serve
from dspark.engine.sweep import CLOCKS
from dspark.engine.target import LiveTarget
from dspark.engine.verify_step import VerifySteps, graph_slot_count
from dspark.models.draft import DraftModel
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.util.validate import check_type
from dspark.verify.layout import check_tiers


class SpecDecoder:
    """Target + drafter with their paged KV caches; serves a queue of prompts with one policy per run.

    clock: how step phases are timed. `wall` (perf_counter) or, on the CPU with one intra-op thread,
    `thread` (this thread's CPU time): the same number on an idle machine, and not charged while other
    processes hold the core on a shared one. It still moves with neighbours sharing caches or an SMT
    sibling (back-to-back runs here: up to 1.6x apart, `perf/engine_timing_noise.py`), which is why
    comparisons run in `lockstep`.
    """

    def __init__(self, target: TransformersCausalLM, draft: DraftModel | Drafter, *, cache_tokens: int = 65536,
                 page_size: int = 16, device: str | torch.device = "cpu", tiers: Sequence[int] | None = None,
                 clock: str = "wall", tokenizer: Any = None):
        """target: the model verified against; draft: a `DraftModel` (served by a `BlockDrafter`) or any
        `Drafter` (`NgramDrafter`, `CausalLMDrafter`, ...), checked against the target (vocabulary, geometry;
        its tokenizer against `tokenizer`, the target's, when both are given). cache_tokens / page_size: each
        model's paged KV cache; tiers: captured token tiers of compact steps; clock: see the class."""
        if not isinstance(target, TransformersCausalLM):
            raise TypeError(f"target must be a dspark.models.TransformersCausalLM, got {type(target).__name__}")
        if not isinstance(draft, (DraftModel, Drafter)):
            raise TypeError(f"draft must be a dspark.models.DraftModel or a Drafter (NgramDrafter, CausalLMDrafter, "
                            f"...), got {type(draft).__name__}")
        self.drafter = BlockDrafter(draft) if isinstance(draft, DraftModel) else draft
        self.drafter.check_target(target, tokenizer)
        self.draft = self.drafter.draft if isinstance(self.drafter, BlockDrafter) else None
        self.device = check_device(device)
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
        if clock == "thread" and self.device.type != "cpu":
            raise ValueError(f"clock 'thread' (this thread's CPU time) times CPU work only; device is {self.device}")
        self.clock = clock
        self._now = time.perf_counter if clock == "wall" else time.thread_time
        self.tiers = check_tiers(tiers)
        self.target = target.to(self.device).eval()
        self.tcache = model_cache(target.geometry, -(-cache_tokens // page_size), page_size, self.device,
                                  target.hf_model.dtype)
        self._bind()
        self._generations = itertools.count(1)  # admission numbers: the lag ring's generation guard
        self._running = False  # a started run has not finished

    def _bind(self) -> None:
        """This decoder's verify steps and target over its cache, and its own bound copy of the drafter."""
        self._verify_steps = VerifySteps(self.target, self.tcache, self.tiers)
        self._target = LiveTarget(self.target, self.tcache, self._verify_steps, self.tiers)
        self._drafter = self.drafter.bind(self._target, pages=self.tcache.allocator.num_pages,
                                          page_size=self.tcache.page_size, device=self.device)

    def fork(self, tiers: Sequence[int] | None = None) -> SpecDecoder:
        """A decoder with this one's models, drafter, device, clock and tiers (or their subset `tiers`:
        `serving_tiers`) and its own KV caches: one decoder per run lets runs be interleaved step by step
        (`lockstep`)."""
        twin = copy.copy(self)
        twin.tiers = self.tiers if tiers is None else check_tiers(tiers, within=self.tiers)
        twin.tcache = model_cache(self.target.geometry, self.tcache.allocator.num_pages, self.tcache.page_size,
                                  self.device, self.tcache.k.dtype)
        twin._bind()
        twin._generations, twin._running = itertools.count(1), False
        return twin

    def graph_slots(self, b: int, width: int) -> int | None:
        """Slot count of a tier-padded compact step (`verify_step.graph_slots`); None without tiers."""
        return graph_slot_count(b, self.tiers, width) if self.tiers else None

    # -- decoding --------------------------------------------------------------------------------------
    def generate(self, prompts: Prompts, max_new_tokens: int | Tensor, policy: Policy, *,
                 mode: VerifyMode | str = VerifyMode.COMPACT, sampling: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 reserve_new_tokens: int | None = None, max_batch: int | None = None,
                 stop_token_ids: Sequence[int] = (), keep_draft_logits: bool = False) -> GenerateResult:
        """Decode up to `max_new_tokens` after each prompt with one policy.

        prompts: an int64 tensor [N, P], or N token-id sequences of any lengths (each >= 1 token).
        max_new_tokens: one count for every request, or an int64 tensor [N] of per-request counts;
        result.tokens is [N, max] with zeros past each request's end (result.num_tokens, finish_reasons).
        stop_token_ids: a committed one ends its request (kept in the output; later tokens of the same
        step are dropped), e.g. the tokenizer's EOS.
        sampling: draw from the target's distribution at `temperature`, restricted to the `top_k` most likely
        tokens and the `top_p` nucleus when given (transformers' warps, in its order), from a generator seeded
        with `seed`; the drafter's proposals are warped the same way and rejection sampling keeps the
        committed tokens distributed as the warped target's. Greedy (the default) ignores all four.
        max_batch: continuous batching. At most `max_batch` requests (default: all N) decode at once; a
        finished request's slot is refilled at once with the next queued prompt (prefilled, timed, with a new
        generation number). Request i always gets prompt i, so result.tokens[i] is comparable across policies
        and batch sizes.
        reserve_new_tokens: size the KV pages for this many new tokens when larger (profiling times short
        runs with the geometry of the timed ones).
        keep_draft_logits: keep each speculative step's drafter token logits [B, k, V] in its StepOutcome
        (`draft_logits`: the top-2 margin baseline, the estimator's features); off by default, as they take
        B x k x V floats per step.
        """
        return finish(self.start(prompts, max_new_tokens, policy, mode=mode, sampling=sampling,
                                 temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                 reserve_new_tokens=reserve_new_tokens, max_batch=max_batch, stop_token_ids=stop_token_ids,
                                 keep_draft_logits=keep_draft_logits))

    def start(self, prompts: Prompts, max_new_tokens: int | Tensor, policy: Policy, *,
              mode: VerifyMode | str = VerifyMode.COMPACT, sampling: bool = False, temperature: float = 1.0,
              top_k: int | None = None, top_p: float | None = None, seed: int = 0,
              reserve_new_tokens: int | None = None, max_batch: int | None = None,
              stop_token_ids: Sequence[int] = (), keep_draft_logits: bool = False) -> DecodeRun:
        """`generate` one step at a time: checks the arguments now and returns the run, a generator that
        yields each StepOutcome and returns the GenerateResult (`finish` drains it). Runs on different
        decoders (`fork`) can be interleaved step by step (`dspark.engine.lockstep`)."""
        mode = VerifyMode.parse(mode)
        vocab = self.target.geometry.vocab_size
        seqs = check_prompts(prompts, vocab)
        n, p = len(seqs), max(q.numel() for q in seqs)
        new_tokens = check_new_tokens(max_new_tokens, n)
        stop = check_stop_ids(stop_token_ids, vocab)
        check_positive_or_none("max_batch", max_batch)
        check_type("policy", policy, Policy)
        check_type("keep_draft_logits", keep_draft_logits, bool)
        k, most = policy.num_drafts, self.drafter.max_drafts
        if most is not None and k > most:
            raise ValueError(f"policy {policy.name!r} drafts {k} tokens but the drafter proposes at most {most} "
                             f"(gamma must be in [0, {most}])")
        w = k + 1
        check_positive_or_none("reserve_new_tokens", reserve_new_tokens)
        new = max(int(new_tokens.max()), reserve_new_tokens or 0)
        max_len = check_seq_len((self.target,), p, new, w)
        if self.drafter.max_seq_len is not None:
            check_fits(p, new, w, self.drafter.max_seq_len, f"the {type(self.drafter).__name__}'s",
                       "shorten the prompts or max_new_tokens")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        draws = Sampling(sampling, temperature, gen, top_k, top_p)
        self._check_idle()
        scheduler = Scheduler(seqs, new_tokens, None if stop is None else stop.to(self.device), self._generations,
                              self.device)
        return self._run(scheduler, policy, mode, draws, min(n, max_batch or n), max_len, w, p + w + policy.catch_up,
                         keep_draft_logits)

    @torch.no_grad()
    def _run(self, scheduler: Scheduler, policy: Policy, mode: VerifyMode, sampling: Sampling, b: int,
             max_len: int, w: int, max_rows: int, keep_draft_logits: bool) -> DecodeRun:
        self._check_idle()  # (a second run started on this decoder before this one began)
        self._running = True
        try:
            batch = Batch.empty(b, max_len, self.device)
            engine = Engine(self._drafter, self._target, self._now, self._sync, keep_draft_logits)
            return (yield from serve(engine, scheduler, batch, policy, mode=mode, sampling=sampling, width=w,
                                     max_rows=max_rows))
        finally:
            self._running = False

    def _sync(self) -> None:
        """End of a timed step or prefill on an accelerator: wait for its kernels, so the step is charged its own
        device time (else the next step's first read, maybe another lockstep run's, would be charged for it)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _check_idle(self) -> None:
        if self._running:
            raise RuntimeError("this decoder is already running a generation (one run per decoder at a time; "
                               "`fork` a decoder for each run to interleave them)")

