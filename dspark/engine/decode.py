"""The live engine: a target + the block draft over their paged KV caches, serving a queue with one policy.

`SpecDecoder` wires a `LiveTarget` (transformers' own model code over dspark's paged KV cache) and a
`BlockDrafter` (the draft reads the target's final hidden state one position back) into the shared run
loop, `dspark.engine.step.serve`. Host syncs per step, counted in the telemetry: the verify lengths (to
build the layout) and the commit lengths (next positions, stop test); a target-only step needs only the
second.
"""
from __future__ import annotations

import copy
import itertools
import time
from typing import Sequence

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
    check_seq_len,
    check_stop_ids,
)
from dspark.engine.drafter import BlockDrafter
from dspark.engine.kv_cache import PagedKVCache
from dspark.engine.policies import Policy
from dspark.engine.results import DecodeRun, GenerateResult, finish
from dspark.engine.sampling import Sampling
from dspark.engine.step import Engine, serve
from dspark.engine.sweep import CLOCKS
from dspark.engine.target import LiveTarget
from dspark.engine.verify_step import VerifySteps, graph_slots
from dspark.models.draft import DraftModel
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.util.validate import check_type
from dspark.verify.layout import check_tiers


class SpecDecoder:
    """Target + draft with their paged KV caches; serves a queue of prompts with one policy per run.

    clock: how step phases are timed. `wall` (perf_counter) or, on the CPU with one intra-op thread,
    `thread` (this thread's CPU time): the same number on an idle machine, and not charged while other
    processes hold the core on a shared one. It still moves with neighbours sharing caches or an SMT
    sibling (back-to-back runs here: up to 1.6x apart, `perf/engine_timing_noise.py`), which is why
    comparisons run in `lockstep`.
    """

    def __init__(self, target: TransformersCausalLM, draft: DraftModel, *, cache_tokens: int = 65536,
                 page_size: int = 16, device: str | torch.device = "cpu", tiers: Sequence[int] | None = None,
                 clock: str = "wall"):
        if not isinstance(target, TransformersCausalLM):
            raise TypeError(f"target must be a dspark.models.TransformersCausalLM, got {type(target).__name__}")
        if not isinstance(draft, DraftModel):
            raise TypeError(f"draft must be a dspark.models.DraftModel, got {type(draft).__name__}")
        if draft.geometry.hidden_size != target.geometry.hidden_size or draft.cfg.vocab_size != target.geometry.vocab_size:
            raise ValueError(f"the draft reads hidden size {draft.geometry.hidden_size} / vocab {draft.cfg.vocab_size} "
                             f"but the target has {target.geometry.hidden_size} / {target.geometry.vocab_size}: "
                             f"load the draft trained for this target")
        self.device = check_device(device)
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
        if clock == "thread" and self.device.type != "cpu":
            raise ValueError(f"clock 'thread' (this thread's CPU time) times CPU work only; device is {self.device}")
        self.clock = clock
        self._now = time.perf_counter if clock == "wall" else time.thread_time
        self.tiers = check_tiers(tiers)
        self.target = target.to(self.device).eval()
        self.draft = draft.to(self.device).eval()
        pages = -(-cache_tokens // page_size)
        self.tcache = self._cache(target, pages, page_size)
        self.dcache = self._cache(draft, pages, page_size)
        self._verify_steps = VerifySteps(self.target, self.tcache, self.tiers)
        self._target = LiveTarget(self.target, self.tcache, self._verify_steps, self.tiers)
        self._generations = itertools.count(1)  # admission numbers: the lag ring's generation guard
        self._running = False  # a started run has not finished

    def fork(self, tiers: Sequence[int] | None = None) -> SpecDecoder:
        """A decoder with this one's models, device, clock and tiers (or their subset `tiers`: `serving_tiers`)
        and its own KV caches: one decoder per run lets runs be interleaved step by step (`lockstep`)."""
        twin = copy.copy(self)
        twin.tiers = self.tiers if tiers is None else check_tiers(tiers, within=self.tiers)
        pages = self.tcache.allocator.num_pages
        twin.tcache = self._cache(self.target, pages, self.tcache.page_size)
        twin.dcache = self._cache(self.draft, pages, self.dcache.page_size)
        twin._verify_steps = VerifySteps(self.target, twin.tcache, twin.tiers)
        twin._target = LiveTarget(self.target, twin.tcache, twin._verify_steps, twin.tiers)
        twin._generations, twin._running = itertools.count(1), False
        return twin

    def _cache(self, model: TransformersCausalLM | DraftModel, pages: int, page_size: int) -> PagedKVCache:
        g = model.geometry
        return PagedKVCache(num_layers=g.num_layers, num_heads=g.num_kv_heads, head_dim=g.head_dim, num_pages=pages,
                            page_size=page_size, device=self.device)

    def graph_slots(self, b: int, width: int) -> int | None:
        """Slot count of a tier-padded compact step (`verify_step.graph_slots`); None without tiers."""
        return graph_slots(b, self.tiers, width) if self.tiers else None

    # -- decoding --------------------------------------------------------------------------------------
    def generate(self, prompts: Prompts, max_new_tokens: int | Tensor, policy: Policy, *,
                 mode: VerifyMode | str = VerifyMode.COMPACT, sampling: bool = False, temperature: float = 1.0,
                 seed: int = 0, reserve_new_tokens: int | None = None, slots: int | None = None,
                 stop_token_ids: Sequence[int] = ()) -> GenerateResult:
        """Decode up to `max_new_tokens` after each prompt with one policy.

        prompts: an int64 tensor [N, P], or N token-id sequences of any lengths (each >= 3 tokens).
        max_new_tokens: one count for every request, or an int64 tensor [N] of per-request counts;
        result.tokens is [N, max] with zeros past each request's end (result.num_tokens, finish_reasons).
        stop_token_ids: a committed one ends its request (kept in the output; later tokens of the same
        step are dropped), e.g. the tokenizer's EOS.
        slots: continuous batching. At most `slots` requests (default: all N) decode at once; a finished
        request's slot is refilled at once with the next queued prompt (prefilled, timed, with a new
        generation number). Request i always gets prompt i, so result.tokens[i] is comparable across policies
        and slot counts.
        reserve_new_tokens: size the KV pages for this many new tokens when larger (profiling times short
        runs with the geometry of the timed ones).
        """
        return finish(self.start(prompts, max_new_tokens, policy, mode=mode, sampling=sampling,
                                 temperature=temperature, seed=seed, reserve_new_tokens=reserve_new_tokens,
                                 slots=slots, stop_token_ids=stop_token_ids))

    def start(self, prompts: Prompts, max_new_tokens: int | Tensor, policy: Policy, *,
              mode: VerifyMode | str = VerifyMode.COMPACT, sampling: bool = False, temperature: float = 1.0,
              seed: int = 0, reserve_new_tokens: int | None = None, slots: int | None = None,
              stop_token_ids: Sequence[int] = ()) -> DecodeRun:
        """`generate` one step at a time: checks the arguments now and returns the run, a generator that
        yields each StepOutcome and returns the GenerateResult (`finish` drains it). Runs on different
        decoders (`fork`) can be interleaved step by step (`dspark.engine.lockstep`)."""
        mode = VerifyMode.parse(mode)
        vocab = self.target.geometry.vocab_size
        seqs = check_prompts(prompts, vocab)
        n, p = len(seqs), max(q.numel() for q in seqs)
        new_tokens = check_new_tokens(max_new_tokens, n)
        stop = check_stop_ids(stop_token_ids, vocab)
        check_positive_or_none("slots", slots)
        check_type("policy", policy, Policy)
        k = policy.num_drafts
        if k > self.draft.gamma:
            raise ValueError(f"policy {policy.name!r} drafts {k} tokens but the draft model has only "
                             f"{self.draft.gamma} heads (gamma must be in [0, {self.draft.gamma}])")
        w = k + 1
        check_positive_or_none("reserve_new_tokens", reserve_new_tokens)
        max_len = check_seq_len((self.target, self.draft), p, max(int(new_tokens.max()), reserve_new_tokens or 0), w)
        self._check_idle()
        scheduler = Scheduler(seqs, new_tokens, None if stop is None else stop.to(self.device), self._generations,
                              self.device)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        return self._run(scheduler, policy, mode, Sampling(sampling, temperature, gen), min(n, slots or n), max_len,
                         w, p + w + policy.catch_up)

    @torch.no_grad()
    def _run(self, scheduler: Scheduler, policy: Policy, mode: VerifyMode, sampling: Sampling, b: int,
             max_len: int, w: int, max_rows: int) -> DecodeRun:
        self._check_idle()  # (a second run started on this decoder before this one began)
        self._running = True
        try:
            batch = Batch.empty(b, max_len, self.device)
            engine = Engine(BlockDrafter(self.draft, self.dcache, self._target),
                            self._target, self._now, self._sync)
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

