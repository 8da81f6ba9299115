"""The replay's plug-ins: a drafter that reads a recorded trace, a target that commits what the trace says it
accepts, and a simulated clock that a cost model advances.

Under greedy decoding a request's state is its committed length alone: at t tokens past its prompt the draft
proposed `trace.block(...)` and the target accepted a(t) of those drafts, whatever policy brought it there.
So a step verifying `verify_len` rows commits `min(a(t), verify_len - 1) + 1` tokens, the next ones of the
recorded greedy continuation. Time comes from `ServingCost.price` of what the step did (`step_work`): the drafter
advances the clock by the proposal's seconds (its depth, its requests), the target by the verify or plain step's
(rows, the requests' own KV tokens), and by the prefill of the prompts admitted before the step (a forward
of its own, or folded into the step's: `Target.fold`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.config import VerifyMode
from dspark.cost.serving import ServingCost, StepWork
from dspark.lab.replay.trace import Trace
from dspark.serve.drafters.base import Drafter, Drafts, Source
from dspark.serve.runner import Target, Verified, mode_layout
from dspark.serve.sampling import Sampling
from dspark.serve.scheduler import Batch
from dspark.verify.accept import AcceptResult
from dspark.verify.layout import RaggedVerifyLayout


class SimClock:
    """Simulated seconds: `now()` for the engine's phase timing, `advance(seconds)` by the simulated target."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def now(self) -> float:
        return self.seconds

    def advance(self, seconds: float) -> None:
        self.seconds += seconds


def step_work(batch: Batch, slots: Tensor, rows: int, drafts: int, folded: int = 0) -> StepWork:
    """The target's share of a step over `slots` (host ids): `rows` rows, `drafts` drafts per request (0: plain),
    KV tokens = the cached tokens of those requests (their committed length minus the root, which is a row), and
    the most one holds, and `folded` prompt tokens that ride its forward. The drafter's share is priced apart
    (`ServingCost.draft_seconds`), so `drafting` is 0 here."""
    cached = batch.lens[slots] - 1
    return StepWork(requests=slots.numel(), rows=rows, kv_tokens=int(cached.sum()), drafts=drafts,
                    kv_longest=int(cached.max()), prefill_tokens=folded, prefill_folded=folded > 0)


def positions(batch: Batch, slots: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """(trace request ids [B], tokens past the prompt t [B]) of `slots` (host ids); ids [N]: the trace
    request of each queued request."""
    return ids[batch.owners[slots]], batch.lens[slots] - batch.prompt_lens[slots]


class TraceDrafter(Drafter):
    """Proposes the recorded block at each request's position: its first k drafts, with the head's
    confidence logits or the estimator's features (float32, as the live drafter computed them); each proposal
    advances `clock` by the cost model's seconds for k drafts over its requests and the tokens a live drafter
    would catch up beyond their roots (committed since its last proposal; the whole prompt after admission)."""

    def __init__(self, trace: Trace, ids: Tensor, cost: ServingCost, clock: SimClock) -> None:
        self.trace, self.ids, self.cost, self.clock = trace, ids, cost, clock
        self.max_drafts = trace.gamma
        self._seen = torch.zeros(0, dtype=torch.int64)  # host [S]: committed length at the slot's last proposal

    def start(self, batch: Batch, max_rows: int) -> None:
        self._seen = torch.zeros(batch.num_slots, dtype=torch.int64)

    def admit(self, slots: Tensor) -> None:
        self._seen[slots] = 0

    def propose(self, batch: Batch, slots: Tensor, k: int, source: Source, sampling: Sampling) -> Drafts:
        lens = batch.lens[slots]
        catch_up = int((lens - self._seen[slots] - 1).sum())
        self._seen[slots] = lens
        self.clock.advance(self.cost.draft_seconds(slots.numel(), k, catch_up))
        return trace_drafts(self.trace, self.ids, batch, slots, k, source, catch_up)


class SimTarget(Target):
    """Commits the trace's greedy continuation: `min(a(t), cap - 1) + 1` tokens per request (cap: the verify
    length, or W in static mode); each step and each prefill advances `clock` by the cost model's seconds."""

    def __init__(self, trace: Trace, ids: Tensor, cost: ServingCost, clock: SimClock,
                 tiers: tuple[int, ...] = ()) -> None:
        self.trace, self.ids, self.cost, self.clock, self.tiers = trace, ids, cost, clock, tiers
        self._folded: int | None = None  # prompt tokens that ride the next forward

    def prefill(self, batch: Batch, slots: Tensor) -> None:
        self.clock.advance(self.cost.prefill.seconds(int((batch.prompt_lens[slots] - 1).sum())))

    def fold(self, batch: Batch, slots: Tensor) -> None:
        self._folded = (self._folded or 0) + int((batch.prompt_lens[slots] - 1).sum())

    def _advance(self, batch: Batch, slots: Tensor, rows: int, drafts: int) -> None:
        folded, self._folded = self._folded or 0, None
        self.clock.advance(self.cost.price(step_work(batch, slots, rows, drafts, folded)))

    def plain(self, batch: Batch, slots: Tensor, layout: RaggedVerifyLayout, sampling: Sampling) -> Tensor:
        self._advance(batch, slots, slots.numel(), 0)
        return self.trace._greedy_block(*positions(batch, slots, self.ids), 1)

    def verify(self, batch: Batch, slots: Tensor, drafts: Drafts, verify_lens: Tensor, mode: VerifyMode,
               layout: RaggedVerifyLayout | None) -> Verified:
        layout, caps = mode_layout(mode, verify_lens, drafts.tokens.shape[1] + 1, layout,
                                   self.tiers if mode is VerifyMode.COMPACT else (), None)
        self._advance(batch, slots, layout.total_rows, drafts.tokens.shape[1])
        return Verified(layout, caps, positions(batch, slots, self.ids))

    def accept(self, verified: Verified, drafts: Drafts, sampling: Sampling) -> AcceptResult:
        return trace_accept(self.trace, *verified.rows, verified.caps, drafts.tokens.shape[1])


def trace_drafts(trace: Trace, ids: Tensor, batch: Batch, slots: Tensor, k: int, source: Source,
                 catch_up: int) -> Drafts:
    """The recorded block's first k drafts at the position of each request in `slots` (host ids; ids [N]: the
    trace request of each queued request), with the head's confidence logits or, for source "features", the
    estimator's features (host tensors, float32 as the live drafter computed them)."""
    block = trace._block(*positions(batch, slots, ids))
    tokens = block.drafts[:, :k].to(torch.int64)
    if source == "features":
        return Drafts(tokens, features=block.features[:, :k], catch_up=catch_up)
    return Drafts(tokens, confidence_logits=block.confidence_logits[:, :k], catch_up=catch_up)


def trace_accept(trace: Trace, requests: Tensor, t: Tensor, caps: Tensor, k: int) -> AcceptResult:
    """What the trace says a step of k drafts commits for trace requests [B] at positions t [B] (host), capped
    to caps [B] (host) rows: `min(a(t), cap - 1) + 1` tokens of the greedy continuation (-1 past them)."""
    accepted = trace._block(requests, t).accepted.clamp(max=k)
    caps = caps.to(torch.int64)
    correct = torch.minimum(accepted, caps - 1)
    commit = correct + 1
    cols = torch.arange(k + 1)
    tokens = torch.where(cols[None, :] < commit[:, None], trace._greedy_block(requests, t, k + 1), -1)
    proposed = cols[None, :k] < (caps - 1)[:, None]
    return AcceptResult(correct_lens=correct.to(torch.int32), commit_lens=commit.to(torch.int32),
                        bonus=tokens.gather(1, correct[:, None]).squeeze(1), tokens=tokens, proposed=proposed,
                        accepted=cols[None, :k] < correct[:, None])
