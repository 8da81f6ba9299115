"""`Adaptive`: draft gamma tokens and let dspark's VerifyPlanner pick per-request verify lengths from the calibrated
confidence (lagged budget, live allocation, tier fill); the confidence comes from the draft's trained head, or
with `estimator=` from an online estimator. Given the profiled plain-step time, each step first passes the
speculate-or-not gate (`gate.SpeculationGate`), which compares the best speculative step, priced from the
realised acceptance (`feedback.RealisedAcceptance`) or the lagged survival, with a plain one. How each piece
decides: docs/policies.md.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

import torch
from torch import Tensor

from dspark.calibration.online import OnlineAcceptanceEstimator
from dspark.plan.planner import VerifyPlanner
from dspark.serve.drafters.base import Drafts
from dspark.serve.policies.base import Policy, PolicyPlan
from dspark.serve.policies.feedback import RealisedAcceptance
from dspark.serve.policies.gate import GateSettings, SpeculationGate
from dspark.util.validate import check_int, check_type
from dspark.verify import boundary
from dspark.verify.accept import AcceptResult

if TYPE_CHECKING:
    from dspark.serve.outcome import StepOutcome


@dataclass(frozen=True)
class FeedbackSettings:
    """decay: per-request-outcome decay of the realised acceptance averages the gate reads once they exist (None:
    lagged survival only); prior_weight: outcomes the mean of the plans' calibrated predictions is worth."""

    decay: float | None = 0.985
    prior_weight: int = 16

    def __post_init__(self) -> None:
        d = self.decay
        if d is not None and not (isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d < 1):
            raise ValueError(f"feedback decay must be in [0, 1) or None, got {d!r}")
        check_int("prior_weight", self.prior_weight, 0)


class Adaptive(Policy):
    """dspark's VerifyPlanner: budget from lagged calibrated survival and the cost model, live allocation.

    planner: the VerifyPlanner (its gamma is the drafts per step). plain_seconds: B -> seconds of a target-only
    step, profiled like the planner's cost model (asked once per B); with it each step first passes the
    speculate-or-not gate (`gate`: its probe schedule and cost feedback). feedback: the realised-acceptance
    averages the gate reads. estimator: an OnlineAcceptanceEstimator in place of the draft's head (the planner
    then needs temperatures=None and its gamma). depths: planners for shallower drafts {k: planner with gamma k},
    lag 0 like `planner`; with them the gate also picks the depth, from the realised acceptance per position priced
    by each depth's planner (a probe drafts gamma; until each position has `prior_weight` outcomes of its own every
    step speculates at gamma: the warm-up). With the feedback on, a large batch's probes that are not close calls
    draft for `gate.probe_requests` requests only (`GateSettings`); without it every probe drafts for the whole
    batch. One policy object serves one run; `resume` carries an earlier run's realised acceptance into it.
    """

    name = "adaptive"

    def __init__(self, planner: VerifyPlanner, plain_seconds: Callable[[int], float] | None = None,
                 gate: GateSettings = GateSettings(), feedback: FeedbackSettings = FeedbackSettings(),
                 estimator: OnlineAcceptanceEstimator | None = None,
                 depths: Mapping[int, VerifyPlanner] | None = None):
        check_type("gate", gate, GateSettings)
        check_type("feedback", feedback, FeedbackSettings)
        if estimator is not None:
            check_type("estimator", estimator, OnlineAcceptanceEstimator)
            if estimator.gamma != planner.cfg.gamma or planner.temperatures is not None:
                raise ValueError(f"the estimator (gamma={estimator.gamma}) needs a planner with its gamma and "
                                 f"temperatures=None, got gamma={planner.cfg.gamma} and temperatures "
                                 f"{None if planner.temperatures is None else planner.temperatures.tolist()}")
        depths = dict(depths or {})
        for k, p in depths.items():
            check_type(f"depths[{k}]", p, VerifyPlanner)
            if not 1 <= k < planner.cfg.gamma or p.cfg.gamma != k:
                raise ValueError(f"depths maps a depth k in [1, {planner.cfg.gamma - 1}] to a planner with gamma k, "
                                 f"got {k} -> gamma {p.cfg.gamma}")
            if p.ring is not None or planner.ring is not None:
                raise ValueError(f"choosing the depth needs lag-0 planners, got lag {planner.lag} / {p.lag}")
        self.estimator = estimator
        self.source = "head" if estimator is None else "features"
        # its observe reads host copies only (`to_host_later`); the estimator's labels read the device: in order
        self.observe_deferrable = estimator is None
        self._features: tuple[Tensor, Tensor | None] | None = None  # the latest step's estimator features, drafters
        self.gamma = planner.cfg.gamma
        self._planners = {**depths, self.gamma: planner}  # depth -> its planner
        self.greedy_only = any(p.settings.live_argmax for p in self._planners.values())
        self._by_depth = sorted(self._planners.items())
        self.planner = planner  # the current depth's planner
        self.num_drafts = self.gamma
        self.plain_seconds = plain_seconds
        self._plain_at = None if plain_seconds is None else functools.cache(plain_seconds)  # once per B
        if feedback.decay is None:  # a partial probe informs the realised acceptance only: without it, whole
            gate = dataclasses.replace(gate, probe_requests=None)
        self.gate = SpeculationGate(gate)
        # plain steps in a row before a probe: tokens the draft catches up (a partial probe leaves some requests
        # undrafted for longer: no bound but their own length)
        wait = gate.max_probe_every if gate.probe_budget is None else max(gate.max_probe_every, gate.max_probe_wait)
        self.catch_up = wait if gate.probe_requests is None else None
        self._catch_up = False  # the next speculative step's draft catches up on plain steps' tokens
        self.feedback_settings = feedback
        self.feedback = RealisedAcceptance(self.gamma, feedback.decay or 0.0, feedback.prior_weight)
        # the speculative step awaiting its outcome: host copies of its verify lengths and survival, its drafters
        self._pending: tuple[Tensor, Tensor, Tensor | None] | None = None
        slots = planner.ring.num_slots if planner.ring is not None else 0
        self._unseen = torch.zeros(slots, dtype=torch.int64)  # per slot: planned steps until its survival is read

    @property
    def draft_depths(self) -> tuple[int, ...]:
        return tuple(sorted(self._planners))

    def resume(self, earlier: Adaptive) -> None:
        """Start this run from `earlier`'s realised acceptance: a policy that served earlier runs at the same batch
        size with the same draft depths and feedback (a server's policy is warm after its first requests, not at
        every run). The online estimator is not carried: adaptive-est's is whatever object each policy was built
        with (the demo gives every run the same one). ValueError naming what differs otherwise."""
        check_type("earlier", earlier, Adaptive)
        mine = (self.draft_depths, self.feedback_settings, self.source)
        theirs = (earlier.draft_depths, earlier.feedback_settings, earlier.source)
        if mine != theirs:
            raise ValueError(f"resume needs a policy with the same (draft depths, feedback, confidence source), got "
                             f"{theirs} for this policy's {mine}")
        self.feedback = copy.deepcopy(earlier.feedback)

    @property
    def realised(self) -> tuple[float, float] | None:
        """Moving averages of (accepted, verified) drafts per request per step at depth gamma (None before any
        outcome)."""
        return self.feedback.predict(self.gamma)

    def speculate(self, slots: Tensor, generations: Tensor) -> bool:
        """Before drafting: True to run a speculative step for these requests (at the depth it sets in
        `num_drafts`), False for a plain one."""
        self.gate.begin()
        if self.plain_seconds is None:
            return True
        forced = self.gate.probe(slots.numel())
        if forced is not None:  # a probe: at full depth, for the requests it names
            self._use_depth(self.gamma)
            self.drafting = None if bool(forced.all()) else forced
            return True
        self.drafting = None
        b, gate = slots.numel(), self.gate
        if gate.decided is None or gate.decided[0] != b:
            # same B since the last decision and no admission (`admit`): same requests, same lagged survival
            depth, spec_rate = self._speculative_rate(slots, generations)
            gate.decide(b, depth, spec_rate, self._plain_at(b))
        if gate.decided[1]:
            gate.reset_probes()
            self._use_depth(gate.decided[2])
            return True
        gate.went_plain(self._plain_at(b))
        self._catch_up = True
        return False

    def _use_depth(self, depth: int) -> None:
        self.planner, self.num_drafts = self._planners[depth], depth

    def _speculative_rate(self, slots: Tensor, generations: Tensor) -> tuple[int, float]:
        """(depth, predicted tokens / s) of the best speculative step for these requests: from the realised
        acceptance per position when there is some (each depth priced by its planner's cost model), else from
        the lagged survival (the gamma planner's best theta)."""
        b = slots.numel()
        if self.feedback.mean is not None and len(self._planners) > 1 and (
                min(self.feedback.counts) < self.feedback_settings.prior_weight):
            # choosing the depth: full-depth warm-up until every position's average rests on prior_weight outcomes
            # of its own (an early prior must not drop a position that would then never be observed again)
            return self.gamma, math.inf
        if self.feedback.mean is not None:
            best = (self.gamma, -math.inf)
            for depth, rate in self.depth_rates(b).items():
                if rate > best[1]:  # ties to the shallower depth
                    best = (depth, rate)
            return best
        planner = self._planners[self.gamma]
        if planner.ring is None:  # lag 0: no earlier survival to read; speculate until outcomes exist
            return self.gamma, math.inf
        lagged = planner.ring.read(slots, generations).cpu()
        new = self._unseen[slots.cpu()] > 0
        if new.any() and not new.all():
            lagged[new] = lagged[~new].mean(0)
        return self.gamma, float(planner.best_decision(lagged).theta)

    def depth_rates(self, b: int) -> dict[int, float]:
        """Predicted tokens / s of a speculative step of `b` requests at each draft depth, shallowest first, from
        the realised acceptance (needs an outcome: `realised` is not None): tau = b (1 + accepted drafts per
        request) over the depth's planner's price of the drafts it verifies plus the next step's catch-up of the
        accepted ones. The price is the filled-tier window's at the mean budget (the planner's steps land on the
        tier tops around it), or for one request the mean of the window over its distribution of verified drafts
        (the default tiers hold every row count there, and the price is not linear across them)."""
        if self.feedback.mean is None:
            raise ValueError("depth_rates needs a speculative step's outcome first (realised is None)")
        catch_up, rates = self.gate.settings.catch_up_seconds, {}
        accepted_by_depth, verified_by_depth = self.feedback.by_depth()
        for depth, planner in self._by_depth:
            accepted, verified = accepted_by_depth[depth - 1], verified_by_depth[depth - 1]
            window, floor = planner.filled_seconds_window(b), planner.cfg.floor
            last = len(window) - 1  # b * (cap - floor): the most drafts the depth's planner may verify
            if b == 1:
                spread = self.feedback.verified_distribution(depth)
                seconds = sum(p * window[min(max(0, v + 1 - floor), last)] for v, p in enumerate(spread))
            else:
                seconds = window[min(max(0, round(b * (1 + verified)) - b * floor), last)]
            rates[depth] = b * (1 + accepted) / (seconds + catch_up * b * accepted)
        return rates

    def confidence(self, drafts: Drafts) -> Tensor:
        if self.estimator is None:
            return drafts.confidence_logits
        feats, k = drafts.features, drafts.features.shape[1]
        if k < self.gamma:  # a shallower step: the estimator's columns past k stay unlabelled (censored)
            feats = torch.cat([feats, feats.new_zeros(feats.shape[0], self.gamma - k, feats.shape[2])], 1)
        self._features = feats, self.drafting  # the inputs of this step's labels and who drafted (`observe`)
        return self.estimator.predict(feats)[:, :k]

    def plan(self, confidence_logits: Tensor, slots: Tensor, generations: Tensor,
             prepass: Callable[[], AcceptResult] | None = None) -> PolicyPlan:
        p = self.planner.plan(confidence_logits, slots, generations)
        self.gate.forget()  # the lag ring holds new survival
        # not sampled: a step whose draft catches up plain steps' tokens, or a partial probe
        self.gate.expect(None if self._catch_up or self.drafting is not None else p.step_seconds)
        self._catch_up = self.drafting is not None  # the requests it left out catch up at the next proposal
        if self.planner.ring is not None:
            host_slots = slots.cpu()
            self._unseen[host_slots] = (self._unseen[host_slots] - 1).clamp(min=0)
        if self.plain_seconds is not None and self.feedback_settings.decay is not None:
            # read in `observe`, after the step's commit sync (maybe after the next draft's launch): host copies
            # queued now, so that read waits for no device work
            self._pending = boundary.to_host_later(p.verify_lens), boundary.to_host_later(p.survival), self.drafting
        return PolicyPlan(p.verify_lens, survival=p.survival, layout=p.layout, budget=p.budget)

    def admit(self, slots: Tensor) -> None:
        """New requests took `slots` (host ids; continuous batching): mark them new (no survival of their
        own yet) and re-decide."""
        if self.planner.ring is not None:
            self._unseen[slots] = self.planner.ring.lag
        self.gate.forget()

    def observe_seconds(self, seconds: float, prefill_tokens: int = 0) -> None:
        self.gate.observe_seconds(seconds, prefill_tokens)

    def observe(self, commit_lens: Tensor, outcome: StepOutcome | None = None) -> None:
        """After a step: host commit lengths [B] of its requests; a speculative `outcome` also labels the
        estimator's features."""
        if self.estimator is not None and outcome is not None and outcome.speculated:
            (feats, drafting), caps, correct = self._features, outcome.caps, outcome.correct_lens
            if drafting is not None:  # the requests that drafted (a static verify checks the fillers too)
                rows = boundary.to_device(drafting.nonzero().squeeze(1), feats.device)
                caps, correct, feats = caps[rows], correct[rows], feats[rows]
            self.estimator.observe(verify_lens=caps, correct_lens=correct, features=feats)
        if outcome is not None and not outcome.speculated and self.feedback.mean is not None:
            # a plain step observes nothing: its B outcomes count as the long-run mean (the recent average
            # describes text that has moved on), so one bad streak cannot keep a small batch plain
            self.feedback.observe_plain(outcome.requests.numel())
            self.gate.forget()
        if self._pending is None:
            return
        (lens, survival, drafting), self._pending = self._pending, None
        # the planner's own (already checked) lengths and survival, copied to the host while it planned
        vl, survival = boundary.to_host_list(lens), boundary.to_host_list(survival)
        commit = boundary.to_host_list(commit_lens)
        if drafting is not None:  # a partial probe: the outcomes of the requests that drafted; the rest were plain
            drafted = drafting.tolist()
            vl, survival, commit = ([x for x, d in zip(xs, drafted) if d] for xs in (vl, survival, commit))
            self.feedback.observe_plain(len(drafted) - sum(drafted))
        self.feedback.observe_plan(vl, survival, commit)
        self.gate.forget()
