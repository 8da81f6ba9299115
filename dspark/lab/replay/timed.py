"""The timed replay: the lab's policies driving a real target step (`Lab.run(..., timed=TimedReplay(...))`).

The priced replay (`dspark.lab.replay.sim`) takes each step's outcome from the trace and its time from a cost
model. The timed replay keeps the outcomes and takes the time from a device: every prefill, plain step, verify
and accept runs the live engine's own `LiveTarget` work (paged KV cache, ragged attention, the graph tiers'
`VerifySteps`) over the batch the replay holds, the trace's prompts and greedy continuation, with the trace's
drafts as the verify rows; every proposal runs a real drafter's forward (its catch-up and its k drafts) over
the same tokens. What the models compute is discarded: the step commits what the trace says
(`trace_accept`: `min(a(t), cap - 1) + 1` tokens) and the policies read the trace's confidence logits or
features, so every policy sees the same tokens and the same acceptance as in the priced replay, step for step.
The engine's clock is the wall clock, with a device sync at the end of each timed phase, as `SpecDecoder`'s.

What is not the live engine's: the trace lookups on the host (a proposal's block, a step's commit), the copy
of their small results to the device, a device sync at the end of each proposal (the live planner reads the
drafter's confidence logits, which waits for the drafter; here they come from the host) and one read of the
step's caps before the trace's commit (the live engine's commit read waits for the same kernels). Random
weights suffice for time: a forward's cost does not depend on its values. A trace recorded with a larger
vocabulary than the model's (SmolLM2's 49,152 ids on a tiny test model) is fed to the models modulo their
vocabulary, for timing only; Llama-3.1-8B's 128,256 ids hold SmolLM2's as they are.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
from torch import Tensor

from dspark.config import VerifyMode
from dspark.lab.replay.sim import positions, trace_accept, trace_drafts
from dspark.lab.replay.trace import Trace
from dspark.models.draft import DraftModel
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve.checks import check_device
from dspark.serve.drafters.base import Drafter, Drafts, Source, model_cache
from dspark.serve.drafters.block import BlockDrafter
from dspark.serve.runner import LiveTarget, Target, Verified
from dspark.serve.sampling import Sampling
from dspark.serve.scheduler import Batch
from dspark.serve.step import Engine
from dspark.serve.tier_step import VerifySteps
from dspark.util.validate import check_int, check_type
from dspark.verify import boundary
from dspark.verify.accept import AcceptResult
from dspark.verify.layout import RaggedVerifyLayout


def model_batch(batch: Batch, vocab: int | None) -> Batch:
    """The batch as the models read it: its token ids modulo `vocab` (None: as they are), the rest shared."""
    return batch if vocab is None else dataclasses.replace(batch, tokens=batch.tokens % vocab)


def model_drafts(drafts: Drafts, vocab: int | None) -> Drafts:
    """The drafts as the target verifies them: their token ids modulo `vocab` (None: as they are)."""
    return drafts if vocab is None else dataclasses.replace(drafts, tokens=drafts.tokens % vocab)


class TimedTraceDrafter(Drafter):
    """Runs `drafter` (bound to the timed target) on each proposal for its time, then proposes the trace's block
    (`trace_drafts`) on the device, with the drafter's own catch-up count."""

    def __init__(self, drafter: Drafter, trace: Trace, ids: Tensor, vocab: int | None, device: torch.device) -> None:
        self.drafter, self.trace, self.ids, self.vocab, self.device = drafter, trace, ids, vocab, device
        self.max_drafts = trace.gamma if drafter.max_drafts is None else min(trace.gamma, drafter.max_drafts)

    def start(self, batch: Batch, max_rows: int) -> None:
        self.drafter.start(model_batch(batch, self.vocab), max_rows)

    def admit(self, slots: Tensor) -> None:
        self.drafter.admit(slots)

    def finish(self) -> None:
        self.drafter.finish()

    def propose(self, batch: Batch, slots: Tensor, k: int, source: Source, sampling: Sampling) -> Drafts:
        ran = self.drafter.propose(model_batch(batch, self.vocab), slots, k, source, sampling)
        drafts = trace_drafts(self.trace, self.ids, batch, slots, k, source, ran.catch_up)
        moved = {f: getattr(drafts, f).to(self.device) for f in ("tokens", "confidence_logits", "features")
                 if getattr(drafts, f) is not None}
        boundary.synchronize(self.device)  # the proposal is ready when the planner reads it, as a live drafter's
        return dataclasses.replace(drafts, **moved)


class TimedTraceTarget(Target):
    """Runs `live`'s prefill, plain, verify and accept over the batch (module docstring) and commits what the
    trace says (`trace_accept`; a plain step the next token of the greedy continuation) on the device."""

    def __init__(self, live: LiveTarget, trace: Trace, ids: Tensor, vocab: int | None) -> None:
        self.live, self.trace, self.ids, self.vocab = live, trace, ids, vocab

    def start(self, batch: Batch, widths: tuple[int, ...], max_rows: int) -> None:
        self.live.start(model_batch(batch, self.vocab), widths, max_rows)

    def finish(self) -> None:
        self.live.finish()

    def prefill(self, batch: Batch, slots: Tensor) -> None:
        self.live.prefill(model_batch(batch, self.vocab), slots)

    def fold(self, batch: Batch, slots: Tensor) -> None:
        self.live.fold(model_batch(batch, self.vocab), slots)

    def unfolded(self) -> contextlib.AbstractContextManager[None]:
        return self.live.unfolded()

    def plain(self, batch: Batch, slots: Tensor, layout: RaggedVerifyLayout, sampling: Sampling) -> Tensor:
        self.live.plain(model_batch(batch, self.vocab), slots, layout, sampling)  # the model's tokens: discarded
        return self.trace._greedy_block(*positions(batch, slots, self.ids), 1).to(self.live.device)

    def verify(self, batch: Batch, slots: Tensor, drafts: Drafts, verify_lens: Tensor, mode: VerifyMode,
               layout: RaggedVerifyLayout | None) -> Verified:
        mapped = model_drafts(drafts, self.vocab)
        ran = self.live.verify(model_batch(batch, self.vocab), slots, mapped, verify_lens, mode, layout)
        return Verified(ran.layout, ran.caps, (ran, mapped, positions(batch, slots, self.ids)))

    def accept(self, verified: Verified, drafts: Drafts, sampling: Sampling) -> AcceptResult:
        ran, mapped, (requests, t) = verified.rows
        self.live.accept(ran, mapped, sampling)  # the live accept's work; its outcome is discarded
        res = trace_accept(self.trace, requests, t, verified.caps.cpu(), drafts.tokens.shape[1])
        return AcceptResult(**{f.name: getattr(res, f.name).to(self.live.device) for f in dataclasses.fields(res)})


class TimedReplay:
    """The models a timed replay runs on one device: a target and a drafter, with the target's paged KV cache
    and graph-tier verify steps (kept across runs of the same shape, as a `SpecDecoder` keeps them) and the
    drafter bound to it. Random weights are fine (module docstring).

    target: a `TransformersCausalLM`; drafter: a `Drafter` (`CausalLMDrafter`, `NgramDrafter`, ...) or a
    `DraftModel` (served by a `BlockDrafter`), checked against the target; page_size: the KV pages' tokens;
    compile_model: the verify steps' torch.compile (None: on CUDA, as the live engine)."""

    def __init__(self, target: TransformersCausalLM, drafter: Drafter | DraftModel, *,
                 device: str | torch.device = "cpu", page_size: int = 16, compile_model: bool | None = None) -> None:
        check_type("target", target, TransformersCausalLM)
        check_type("drafter", drafter, (Drafter, DraftModel))
        check_int("page_size", page_size, 1)
        self.drafter = BlockDrafter(drafter) if isinstance(drafter, DraftModel) else drafter
        self.drafter.check_target(target)
        self.device = check_device(device)
        self.target = target.to(self.device).eval()
        self.page_size, self.compile_model = page_size, compile_model
        self._bound: tuple[int, tuple[int, ...], LiveTarget, Drafter] | None = None  # (pages, tiers, target, drafter)

    def engine(self, trace: Trace, ids: Tensor, *, slots: int, max_len: int, tiers: tuple[int, ...]) -> Engine:
        """The engine of one timed run of the trace requests `ids` [N] on `slots` slots whose sequences reach
        `max_len` tokens (prompt + new tokens + verify width), its compact steps padded to `tiers`."""
        for most, owner in ((self.target.geometry.max_seq_len, "target"), (self.drafter.max_seq_len, "drafter")):
            if most is not None and max_len > most:
                raise ValueError(f"the timed run's sequences reach max_len = {max_len} tokens but the timed {owner} "
                                 f"holds {most} positions: build it with more (max_position_embeddings)")
        pages = slots * -(-max_len // self.page_size)
        if self._bound is None or self._bound[0] < pages or self._bound[1] != tiers:
            self._bound = None  # the old cache and verify steps go before the new ones are built
            cache = model_cache(self.target.geometry, pages, self.page_size, self.device, self.target.hf_model.dtype)
            live = LiveTarget(self.target, cache, VerifySteps(self.target, cache, tiers, self.compile_model), tiers)
            bound = self.drafter.bind(live, pages=pages, page_size=self.page_size, device=self.device)
            self._bound = (pages, tiers, live, bound)
        _, _, live, bound = self._bound
        vocab = self.target.geometry.vocab_size
        vocab = None if trace.vocab_size <= vocab else vocab
        return Engine(TimedTraceDrafter(bound, trace, ids, vocab, self.device), TimedTraceTarget(live, trace, ids, vocab),
                      time.perf_counter, self._sync)

    def _sync(self) -> None:
        """End of a timed phase: wait for the device (`SpecDecoder._sync`)."""
        boundary.synchronize(self.device)
