"""The policy plug-in point (`Policy`) and one step's decision (`PolicyPlan`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from torch import Tensor

from dspark.serve.drafters.base import Drafts, Source
from dspark.verify.accept import AcceptResult
from dspark.verify.layout import RaggedVerifyLayout

if TYPE_CHECKING:
    from dspark.serve.outcome import StepOutcome


@dataclass
class PolicyPlan:
    """One step's decision: verify lengths [B] int32 (root included) and what the planner saw."""

    verify_lens: Tensor
    survival: Tensor | None = None        # [B, drafts] live calibrated survival (None without drafts)
    layout: RaggedVerifyLayout | None = None  # the planner's layout (tier-padded) when it built one
    budget: int | None = None


class Policy:
    """The plug-in point for verify budgets. Hooks default to no-ops; a policy overrides what it needs.

    num_drafts: tokens drafted per speculative step (0: target-only). source: what the drafter must return
    per position, its head's confidence logits (`"head"`) or the online estimator's features
    (`"features"`). catch_up: the most tokens committed without the drafter (plain steps) between two of its
    proposals, beyond the verify width (None: no bound but the request's length). drafting: host bool [B] over a
    speculative step's requests, those that draft (the rest verify their root only, as in a plain step), set by
    `speculate`; None: every request drafts. observe_deferrable: the policy's `observe` of a step may run after
    the next step's `speculate`, admissions and draft launch (`EngineConfig.defer_observe`); a policy that keeps
    per-slot or per-step state across those hooks leaves it False, and the engine observes it in order.
    greedy_only: whether draft k's admission may read a later draft's survival (a lag-0 planner's `live_argmax`),
    lossless with greedy decoding only: `SpecDecoder` refuses to sample with it. `Adaptive` sets it from its
    planners; a policy of your own that plans with such a planner sets it too.
    """

    name: str = "policy"
    num_drafts: int = 0
    source: Source = "head"
    catch_up: int | None = 0
    drafting: Tensor | None = None
    observe_deferrable: bool = False
    greedy_only: bool = False

    @property
    def draft_depths(self) -> tuple[int, ...]:
        """Every draft depth this policy's speculative steps may take, ascending (the runner prepares their verify
        widths before the run's first step)."""
        return (self.num_drafts,) if self.num_drafts else ()

    def speculate(self, slots: Tensor, generations: Tensor) -> bool:
        """Before drafting: True for a speculative step for these requests, False for a plain one."""
        return True

    def confidence(self, drafts: Drafts) -> Tensor:
        """Confidence logits [B, k] the plan reads, from the step's drafts."""
        return drafts.confidence_logits

    def plan(self, confidence_logits: Tensor, slots: Tensor, generations: Tensor,
             prepass: Callable[[], AcceptResult] | None = None) -> PolicyPlan:
        """Verify lengths for the step. slots / generations [B] (device): the requests' slots and admission
        numbers. prepass: runs a full static verify outside the step's time and returns its outcome."""
        raise NotImplementedError

    def admit(self, slots: Tensor) -> None:
        """New requests took `slots` (host ids)."""

    def observe(self, commit_lens: Tensor, outcome: StepOutcome | None = None) -> None:
        """After a step: its host commit lengths [B] and what it did."""

    def observe_seconds(self, seconds: float, prefill_tokens: int = 0) -> None:
        """After a step: its measured seconds (draft + plan + verify + accept, no prefill forward of its own) and
        the prompt tokens that rode its forward (chunked prefill: their rows are in those seconds)."""
