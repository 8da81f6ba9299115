"""What a decode run returns: per-step outcomes (`StepOutcome`, with phase times) and the run's
`GenerateResult`; a run itself is a generator of steps (`DecodeRun`) that `finish` drains."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generator

from torch import Tensor

from dspark.serve.policies.base import PolicyPlan
from dspark.verify.layout import RaggedVerifyLayout


@dataclass
class StepTimes:
    draft: float = 0.0
    plan: float = 0.0
    verify: float = 0.0
    accept: float = 0.0
    prefill: float = 0.0  # admitting (prefilling) requests into slots freed just before this step
    host_plan: float = 0.0  # wall seconds of the policy's plan call (measured in a replay too; not in total)

    @property
    def total(self) -> float:
        return self.draft + self.plan + self.verify + self.accept + self.prefill


@dataclass
class StepOutcome:
    """What one step did (device tensors; the caller reads them after the run, no extra syncs)."""

    requests: Tensor               # [B] host slot ids of the unfinished requests this step ran for
    plan: PolicyPlan
    layout: RaggedVerifyLayout     # the verify forward's layout (static modes: B x W; plain steps: B x 1)
    caps: Tensor                   # [B] verify lengths the accept honoured (static: W)
    confidence_logits: Tensor      # [B, k] the draft's raw confidence logits
    commit_lens: Tensor
    correct_lens: Tensor
    times: StepTimes
    host_syncs: int
    useful: int = 0                # tokens committed within max_new_tokens (overshoot past it not counted)
    useful_per_request: Tensor | None = None  # [B] host int64: each request's share of `useful`
    kv_tokens: int = 0             # tokens the step's requests held in the KV cache before it (roots excluded)
    kv_longest: int = 0            # the most of those one request held
    prefill_tokens: int = 0        # prompt tokens prefilled right before this step (its `times.prefill`) or in it
    prefill_folded: bool = False   # those prompts rode this step's target forward (their time is in `times.verify`)
    folded_owners: Tensor | None = None  # [A] host: the requests whose prompts rode it (they decode from the next)
    catch_up: int = 0              # tokens the drafter caught up beyond the roots (Drafts.catch_up; 0: plain)
    drafting: int = 0              # requests that drafted (B, or fewer under `Policy.drafting`; 0: plain)
    draft_logits: Tensor | None = None  # [B, k, V] drafter token logits, with EngineConfig(keep_draft_logits=True)
    owners: Tensor | None = None   # [B] host: the queue index (request id) decoding in each slot

    @property
    def busy_slots(self) -> int:
        """Slots holding a request in this step: those decoding and those whose prompt rode it."""
        return self.requests.numel() + (0 if self.folded_owners is None else self.folded_owners.numel())

    @property
    def speculated(self) -> bool:
        """The step drafted and verified (False: a target-only step)."""
        return self.confidence_logits.shape[-1] > 0


@dataclass
class GenerateResult:
    tokens: Tensor                 # [N, max_new_tokens] committed tokens after each request's prompt
                                   # (zeros past its count or its stop token)
    steps: list[StepOutcome] = field(default_factory=list)
    seconds: float = 0.0           # charged time: the first admission's prefill + every step's
                                   # draft+plan+verify+accept+refill prefill (no oracle prepass)
    startup_seconds: float = 0.0   # prefill of the first admission (all slots at once)
    max_batch: int = 0             # B: requests decoding at once (request-pool slots)
    num_tokens: Tensor | None = None  # [N] int64 tokens produced per request (a stop token included)
    finish_reasons: list[str] = field(default_factory=list)  # per request: "length" or "stop"

    def steady(self) -> tuple[int, float]:
        """(tokens, seconds) of the steady-state window: steps with every slot busy, refills included."""
        busy = [s for s in self.steps if s.busy_slots == self.max_batch]
        return sum(s.useful for s in busy), sum(s.times.total for s in busy)


DecodeRun = Generator[StepOutcome, None, GenerateResult]  # SpecDecoder.start: yields steps, returns the result


def finish(run: DecodeRun) -> GenerateResult:
    """Drive a run to its end; its GenerateResult."""
    while True:
        try:
            next(run)
        except StopIteration as stop:
            return stop.value
