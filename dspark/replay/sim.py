"""The replay's plug-ins: a drafter that reads a recorded trace, a target that commits what the trace says it
accepts, and a simulated clock that a cost model advances.

Under greedy decoding a request's state is its committed length alone: at t tokens past its prompt the draft
proposed `trace.block(...)` and the target accepted a(t) of those drafts, whatever policy brought it there.
So a step verifying `verify_len` rows commits `min(a(t), verify_len - 1) + 1` tokens, the next ones of the
recorded greedy continuation, and takes `T(B, rows)` seconds of the cost model (`T_plain(B)` for a plain step).
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.config import VerifyMode
from dspark.cost.serving import ServingCost
from dspark.engine.batch import Batch
from dspark.engine.drafter import Drafter, Drafts, Source
from dspark.engine.sampling import Sampling
from dspark.engine.target import Target, Verified, mode_layout
from dspark.replay.trace import Trace
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


def step_price(cost: ServingCost, num_requests: int, rows: int, speculated: bool) -> float:
    """The cost model's seconds for one step of `num_requests` requests: `T(B, rows)` of a speculative step
    (rows: its layout's, before tier padding), `T_plain(B)` of a target-only one."""
    if speculated:
        return float(cost.speculative.step_seconds(num_requests=num_requests, rows=rows))
    return float(cost.plain_seconds(num_requests))


def positions(batch: Batch, slots: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """(trace request ids [B], tokens past the prompt t [B]) of `slots` (host ids); ids [N]: the trace
    request of each queued request."""
    return ids[batch.owners[slots]], batch.lens[slots] - batch.prompt_lens[slots]


class TraceDrafter(Drafter):
    """Proposes the recorded block at each request's position: its first k drafts, with the head's
    confidence logits or the estimator's features (float32, as the live drafter computed them)."""

    def __init__(self, trace: Trace, ids: Tensor) -> None:
        self.trace, self.ids = trace, ids
        self.max_drafts = trace.gamma

    def propose(self, batch: Batch, slots: Tensor, k: int, source: Source, sampling: Sampling) -> Drafts:
        block = self.trace.block_from_checked(*positions(batch, slots, self.ids))
        tokens = block.drafts[:, :k].to(torch.int64)
        if source == "features":
            return Drafts(tokens, features=block.features[:, :k])
        return Drafts(tokens, confidence_logits=block.confidence_logits[:, :k])


class SimTarget(Target):
    """Commits the trace's greedy continuation: `min(a(t), cap - 1) + 1` tokens per request (cap: the verify
    length, or W in static mode); each step advances `clock` by the cost model's seconds."""

    def __init__(self, trace: Trace, ids: Tensor, cost: ServingCost, clock: SimClock,
                 tiers: tuple[int, ...] = ()) -> None:
        self.trace, self.ids, self.cost, self.clock, self.tiers = trace, ids, cost, clock, tiers

    def plain(self, batch: Batch, slots: Tensor, layout: RaggedVerifyLayout, sampling: Sampling) -> Tensor:
        self.clock.advance(step_price(self.cost, slots.numel(), slots.numel(), False))
        return self.trace.greedy_from_checked(*positions(batch, slots, self.ids), 1)

    def verify(self, batch: Batch, slots: Tensor, drafts: Drafts, verify_lens: Tensor, mode: VerifyMode,
               layout: RaggedVerifyLayout | None) -> Verified:
        b = slots.numel()
        layout, caps = mode_layout(mode, verify_lens, drafts.tokens.shape[1] + 1, layout,
                                   self.tiers if mode is VerifyMode.COMPACT else (), None)
        self.clock.advance(step_price(self.cost, b, layout.total_rows, True))
        return Verified(layout, caps, positions(batch, slots, self.ids))

    def accept(self, verified: Verified, drafts: Drafts, sampling: Sampling) -> AcceptResult:
        requests, t = verified.rows
        b, k = drafts.tokens.shape
        accepted = self.trace.block_from_checked(requests, t).accepted.clamp(max=k)
        caps = verified.caps.to(torch.int64)
        correct = torch.minimum(accepted, caps - 1)
        commit = correct + 1
        cols = torch.arange(k + 1)
        tokens = torch.where(cols[None, :] < commit[:, None], self.trace.greedy_from_checked(requests, t, k + 1), -1)
        proposed = cols[None, :k] < (caps - 1)[:, None]
        return AcceptResult(correct_lens=correct.to(torch.int32), commit_lens=commit.to(torch.int32),
                            bonus=tokens.gather(1, correct[:, None]).squeeze(1), tokens=tokens, proposed=proposed,
                            accepted=cols[None, :k] < correct[:, None])
