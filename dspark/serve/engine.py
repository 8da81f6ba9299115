"""The live engine: a target + a drafter over their paged KV caches, serving a queue with one policy.

`SpecDecoder` wires a `LiveTarget` (transformers' own model code over dspark's paged KV cache) and a
`Drafter` (the block draft, `BlockDrafter`: it reads the target's final hidden state one position back; the
n-gram `NgramDrafter`; a small causal LM, `CausalLMDrafter`) into the shared run loop,
`dspark.serve.step.serve`. Host syncs per step, counted in the telemetry: the verify lengths (to build the
layout) and the commit lengths (next positions, stop test); a target-only step needs only the second.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any, Sequence

from torch import Tensor

from dspark.config import VerifyMode
from dspark.models.draft import DraftModel
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve.checks import (
    Prompts,
    check_fits,
    check_new_tokens,
    check_positive_or_none,
    check_prompts,
    check_seq_len,
    check_stop_ids,
)
from dspark.serve.clock import CLOCK_FNS
from dspark.serve.config import GREEDY, EngineConfig, SamplingParams
from dspark.serve.drafters.base import Drafter, model_cache
from dspark.serve.drafters.block import BlockDrafter
from dspark.serve.outcome import DecodeRun, GenerateResult
from dspark.serve.policies.base import Policy
from dspark.serve.runner import LiveTarget
from dspark.serve.sampling import Sampling
from dspark.serve.scheduler import Batch, Scheduler
from dspark.serve.step import Engine, serve
from dspark.serve.tier_step import VerifySteps, graph_slot_count
from dspark.util.validate import check_type
from dspark.verify import boundary
from dspark.verify.layout import check_tiers


class SpecDecoder:
    """Target + drafter with their paged KV caches; serves a queue of prompts with one policy per run.

    Compare policies' timings in `dspark.lab.timing.lockstep` runs: back-to-back runs on a shared machine move
    with their neighbours (docs/demo.md).
    """

    def __init__(self, target: TransformersCausalLM, draft: DraftModel | Drafter, config: EngineConfig | None = None,
                 tokenizer: Any = None):
        """target: the model verified against; draft: a `DraftModel` (served by a `BlockDrafter`) or any
        `Drafter` (`NgramDrafter`, `CausalLMDrafter`, ...), checked against the target (vocabulary, geometry;
        its tokenizer against `tokenizer`, the target's, when both are given). config: the decoder's KV cache,
        device, tiers and clock (default `EngineConfig()`)."""
        if not isinstance(target, TransformersCausalLM):
            raise TypeError(f"target must be a dspark.models.TransformersCausalLM, got {type(target).__name__}")
        if not isinstance(draft, (DraftModel, Drafter)):
            raise TypeError(f"draft must be a dspark.models.DraftModel or a Drafter (NgramDrafter, CausalLMDrafter, "
                            f"...), got {type(draft).__name__}")
        self.config = EngineConfig() if config is None else check_type("config", config, EngineConfig)
        self.drafter = BlockDrafter(draft) if isinstance(draft, DraftModel) else draft
        self.drafter.check_target(target, tokenizer)
        self.draft = self.drafter.draft if isinstance(self.drafter, BlockDrafter) else None
        self.device, self.tiers = self.config.device, self.config.tiers
        self.target = target.to(self.device).eval()
        self.tcache = model_cache(target.geometry, -(-self.config.cache_tokens // self.config.page_size),
                                  self.config.page_size, self.device, target.hf_model.dtype)
        self._now = CLOCK_FNS[self.config.clock]  # the step phases' clock
        self._bind()
        self._generations = itertools.count(1)  # admission numbers: the lag ring's generation guard

    def _bind(self) -> None:
        """This decoder's verify steps and target over its cache, and its own bound copy of the drafter."""
        self._verify_steps = VerifySteps(self.target, self.tcache, self.tiers)
        self._target = LiveTarget(self.target, self.tcache, self._verify_steps, self.tiers)
        self._drafter = self.drafter.bind(self._target, pages=self.tcache.allocator.num_pages,
                                          page_size=self.tcache.page_size, device=self.device)

    def fork(self, **changes: Any) -> SpecDecoder:
        """A decoder with this one's models and drafter, its own KV caches, and this one's config with `changes`
        (`EngineConfig` fields; `tiers` a non-empty subset of this decoder's, e.g. the tiers a cost model
        profiled, or None: the same). One decoder per run lets runs be interleaved step by step
        (`dspark.lab.timing.lockstep`)."""
        if changes.get("tiers") is None:
            changes.pop("tiers", None)  # None: this decoder's tiers
        else:
            check_tiers(changes["tiers"], within=self.tiers)
        twin = copy.copy(self)
        twin.config = dataclasses.replace(self.config, **changes)
        twin._now = CLOCK_FNS[twin.config.clock]
        twin.tiers = twin.config.tiers
        twin.tcache = model_cache(self.target.geometry, -(-twin.config.cache_tokens // twin.config.page_size),
                                  twin.config.page_size, self.device, self.tcache.k.dtype)
        twin._bind()
        twin._generations = itertools.count(1)
        return twin

    def graph_slots(self, b: int, width: int) -> int | None:
        """Slot count of a tier-padded compact step (`tier_step.graph_slot_count`); None without tiers."""
        return graph_slot_count(b, self.tiers, width) if self.tiers else None

    # -- decoding --------------------------------------------------------------------------------------
    def generate(self, prompts: Prompts, max_new_tokens: int | Tensor, policy: Policy,
                 sampling: SamplingParams = GREEDY, *, mode: VerifyMode | str = VerifyMode.COMPACT,
                 max_batch: int | None = None, stop_token_ids: Sequence[int] = ()) -> GenerateResult:
        """Decode up to `max_new_tokens` after each prompt with one policy.

        prompts: an int64 tensor [N, P], or N token-id sequences of any lengths (each >= 1 token).
        max_new_tokens: one count for every request, or an int64 tensor [N] of per-request counts;
        result.tokens is [N, max] with zeros past each request's end (result.num_tokens, finish_reasons).
        sampling: greedy (the default) or sampled draws (`SamplingParams`); the drafter's proposals are warped
        like the target's, and rejection sampling keeps the output lossless.
        mode: the verify mode. max_batch: continuous batching; at most `max_batch` requests (default: all N)
        decode at once, a finished request's slot is refilled at once with the next queued prompt (prefilled,
        timed, with a new generation number). Request i always gets prompt i, so result.tokens[i] is
        comparable across policies and batch sizes.
        stop_token_ids: a committed one ends its request (kept in the output; later tokens of the same step are
        dropped), e.g. the tokenizer's EOS.
        """
        run = self.start(prompts, max_new_tokens, policy, sampling, mode=mode, max_batch=max_batch,
                         stop_token_ids=stop_token_ids)
        while True:  # drained here, not in a helper: the step's call stack stays short
            try:
                next(run)
            except StopIteration as stop:
                return stop.value

    def start(self, prompts: Prompts, max_new_tokens: int | Tensor, policy: Policy,
              sampling: SamplingParams = GREEDY, *, mode: VerifyMode | str = VerifyMode.COMPACT,
              max_batch: int | None = None, stop_token_ids: Sequence[int] = ()) -> DecodeRun:
        """`generate` one step at a time: checks the arguments now and returns the run, a generator that
        yields each StepOutcome and returns the GenerateResult (`outcome.finish` drains it). Runs on different
        decoders (`fork`) can be interleaved step by step (`dspark.lab.timing`)."""
        mode = VerifyMode.parse(mode)
        vocab = self.target.geometry.vocab_size
        seqs = check_prompts(prompts, vocab)
        n, p = len(seqs), max(q.numel() for q in seqs)
        new_tokens = check_new_tokens(max_new_tokens, n)
        check_type("sampling", sampling, SamplingParams)
        stop = check_stop_ids(stop_token_ids, vocab)
        check_positive_or_none("max_batch", max_batch)
        check_type("policy", policy, Policy)
        if policy.greedy_only and not sampling.greedy:
            raise ValueError(f"policy {policy.name!r} plans with PlannerSettings(live_argmax=True), lossless with "
                             f"greedy decoding only, got sampling temperature {sampling.temperature}: build its "
                             "planners with live_argmax=False (the greedy scan) to sample")
        k, most = policy.num_drafts, self.drafter.max_drafts
        if most is not None and k > most:
            raise ValueError(f"policy {policy.name!r} drafts {k} tokens but the drafter proposes at most {most} "
                             f"(gamma must be in [0, {most}])")
        w = k + 1
        new = max(int(new_tokens.max()), self.config.reserve_new_tokens or 0)
        max_len = check_seq_len((self.target,), p, new, w)
        if self.drafter.max_seq_len is not None:
            check_fits(p, new, w, self.drafter.max_seq_len, f"the {type(self.drafter).__name__}'s",
                       "shorten the prompts or max_new_tokens")
        self._target.check_idle()
        scheduler = Scheduler(seqs, new_tokens, None if stop is None else stop.to(self.device), self._generations,
                              self.device)
        batch = Batch.empty(min(n, max_batch or n), max_len, self.device)
        engine = Engine(self._drafter, self._target, self._now, self._sync,
                        Sampling.seeded(sampling, self.device), mode, self.config.keep_draft_logits,
                        self.config.fold_prefill, defer_observe=self.config.defers_observe)
        catch_up = new if policy.catch_up is None else min(policy.catch_up, new)
        return serve(engine, scheduler, batch, policy, max_rows=p + w + catch_up)

    def _sync(self) -> None:
        """End of a timed step or prefill on an accelerator: wait for its kernels, so the step is charged its own
        device time (else the next step's first read, maybe another lockstep run's, would be charged for it)."""
        boundary.synchronize(self.device)
