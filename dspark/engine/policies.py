"""Verify-budget policies: how many drafts to propose and how many rows each request verifies.

- `FixedK(k)`: draft k tokens, verify all of them (k = 0 is plain target-only decoding).
- `Adaptive(planner, plain_seconds, probe_every)`: draft gamma tokens, let dspark's VerifyPlanner pick
  per-request verify lengths from the calibrated confidence (lagged budget, live allocation, tier fill);
  the confidence comes from the draft's trained head, or with `estimator=` from an online estimator.
  Given the profiled plain-step time it first decides whether to speculate at all (see `speculate`).
- `Oracle(gamma)`: draft gamma tokens, verify exactly the rows that turn out to be accepted. The
  acceptance is found by a full static verify that is run *outside* the timed step (`prepass`), so its
  time is an upper bound on what any budget policy could reach with this draft and target.
"""
from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

import numpy as np
import torch
from torch import Tensor

from dspark.calibration.online import OnlineAcceptanceEstimator
from dspark.engine.drafter import Drafts, Source
from dspark.engine.feedback import RealisedAcceptance
from dspark.plan.budget import choose_budget
from dspark.plan.planner import VerifyPlan, VerifyPlanner
from dspark.util.validate import check_type
from dspark.verify.accept import AcceptResult
from dspark.verify.layout import RaggedVerifyLayout

if TYPE_CHECKING:
    from dspark.engine.results import StepOutcome


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
    proposals, beyond the verify width.
    """

    name: str = "policy"
    num_drafts: int = 0
    source: Source = "head"
    catch_up: int = 0

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

    def observe_seconds(self, seconds: float) -> None:
        """After a step: its measured seconds (draft + plan + verify + accept, no refill prefill)."""


class FixedK(Policy):
    """Draft k tokens and verify all k (+ the root) for every request."""

    def __init__(self, k: int):
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"fixed-k needs an int k >= 0, got {k!r}")
        self.num_drafts = k
        self.name = f"fixed-{k}"

    def plan(self, confidence_logits: Tensor, slots: Tensor, generations: Tensor,
             prepass: Callable[[], AcceptResult] | None = None) -> PolicyPlan:
        b = confidence_logits.shape[0]
        lens = torch.full((b,), self.num_drafts + 1, dtype=torch.int32, device=confidence_logits.device)
        return PolicyPlan(lens)


class Adaptive(Policy):
    """dspark's VerifyPlanner: budget from lagged calibrated survival and the cost model, live allocation.

    planner: the VerifyPlanner (its gamma is the drafts per step). plain_seconds: B -> seconds of a
    target-only step, profiled like the planner's cost model; with it each step first decides whether to
    speculate at all, probing after `probe_every` plain steps in a row (the interval doubles up to
    `max_probe_every` while probes confirm plain). feedback_decay: per-request-outcome decay of the realised
    acceptance averages the decision reads once they exist (None: lagged survival only), shrunk toward the
    mean of every plan's calibrated prediction so far, worth `prior_weight` outcomes. cost_window: steps
    per median of measured / predicted seconds that rescales each side (None: off). estimator: an
    OnlineAcceptanceEstimator in place of the draft's head (the planner then needs temperatures=None and
    its gamma). depths: planners for shallower drafts {k: planner with gamma k}, lag 0 like `planner`; with
    them the speculate-or-not decision also picks the depth, from the realised acceptance per position priced
    by each depth's planner (a probe drafts gamma; until each position has `prior_weight` outcomes of its own
    every step speculates at gamma: the warm-up).
    One policy object serves one run. How each piece decides, and why: docs/policies.md.
    """

    name = "adaptive"

    def __init__(self, planner: VerifyPlanner, plain_seconds: Callable[[int], float] | None = None,
                 probe_every: int = 8, max_probe_every: int = 64, feedback_decay: float | None = 0.985,
                 cost_window: int | None = 9, prior_weight: int = 16,
                 estimator: OnlineAcceptanceEstimator | None = None,
                 depths: Mapping[int, VerifyPlanner] | None = None):
        for name, v, low in (("probe_every", probe_every, 1), ("max_probe_every", max_probe_every, probe_every),
                             ("cost_window", 1 if cost_window is None else cost_window, 1),
                             ("prior_weight", prior_weight, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if feedback_decay is not None and not (isinstance(feedback_decay, (int, float))
                                               and not isinstance(feedback_decay, bool) and 0 <= feedback_decay < 1):
            raise ValueError(f"feedback_decay must be in [0, 1) or None, got {feedback_decay!r}")
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
        self._features: Tensor | None = None  # the latest step's estimator features
        self.gamma = planner.cfg.gamma
        self._planners = {**depths, self.gamma: planner}  # depth -> its planner
        self.planner = planner  # the current depth's planner
        self.num_drafts = self.gamma
        self.plain_seconds = plain_seconds
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.catch_up = max_probe_every  # plain steps in a row before a probe: tokens the draft catches up
        self._plain_run = 0  # plain steps since the last speculative step
        self._interval = probe_every  # plain steps before the next probe
        self._probe_left = 0  # speculative steps of the current probe still to run
        self._decided: tuple[int, bool] | None = None  # (B, speculate) until the lag ring changes
        self.feedback_decay = feedback_decay
        self.prior_weight = prior_weight
        self.cost_window = cost_window
        self.cost_ratio = {True: 1.0, False: 1.0}  # speculative? -> median of recent measured / predicted seconds
        self._cost_samples = {kind: collections.deque(maxlen=cost_window or 1) for kind in (True, False)}
        self._pending_cost: tuple[bool, float] | None = None  # (speculative, predicted seconds) of this step
        self._catch_up = False  # the next speculative step's draft catches up on plain steps' tokens
        slots = planner.ring.num_slots if planner.ring is not None else 0
        self.feedback = RealisedAcceptance(self.gamma, feedback_decay or 0.0, prior_weight)
        self._pending: VerifyPlan | None = None  # the speculative step awaiting its outcome
        self._unseen = torch.zeros(slots, dtype=torch.int64)  # per slot: planned steps until its survival is read

    @property
    def realised(self) -> tuple[float, float] | None:
        """Moving averages of (accepted, verified) drafts per request per step at depth gamma (None before any
        outcome)."""
        return self.feedback.predict(self.gamma)

    def speculate(self, slots: Tensor, generations: Tensor) -> bool:
        """Before drafting: True to run a speculative step for these requests (at the depth it sets in
        `num_drafts`), False for a plain one."""
        if self.plain_seconds is None:
            return True
        if self._probe_left:  # a probe's second step: timed for the realised-cost feedback
            self._probe_left -= 1
            return True
        if self._plain_run >= self._interval:  # probe, at the full depth: every position is observed again
            self._plain_run = 0
            self._interval = min(2 * self._interval, self.max_probe_every)
            self._probe_left = 0 if self.cost_window is None else 1
            self._use_depth(self.gamma)
            return True
        b = slots.numel()
        if self._decided is None or self._decided[0] != b:
            # same B since the last decision and no admission (`admit`): same requests, same lagged survival
            depth, spec_rate = self._speculative_rate(slots, generations)
            plain_rate = b / (self.plain_seconds(b) * self.cost_ratio[False])
            self._decided = (b, spec_rate / self.cost_ratio[True] > plain_rate, depth)
        if self._decided[1]:
            self._plain_run, self._interval = 0, self.probe_every
            self._use_depth(self._decided[2])
            return True
        self._plain_run += 1
        self._pending_cost = (False, self.plain_seconds(b))
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
                self.feedback.counts.min() < self.prior_weight):
            # choosing the depth: full-depth warm-up until every position's average rests on prior_weight outcomes
            # of its own (an early prior must not drop a position that would then never be observed again)
            return self.gamma, math.inf
        if self.feedback.mean is not None:
            best = (self.gamma, -math.inf)
            for depth, planner in sorted(self._planners.items()):
                accepted, verified = self.feedback.predict(depth)
                rows = min(max(b, round(b * (1 + verified))), b * planner.cfg.width)
                rate = b * (1 + accepted) / float(planner.cost_model.seconds_curve(b, rows, 1)[0])
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
        return self.gamma, choose_budget(lagged, planner.cost_model, planner.cfg).theta

    def confidence(self, drafts: Drafts) -> Tensor:
        if self.estimator is None:
            return drafts.confidence_logits
        feats, k = drafts.features, drafts.features.shape[1]
        if k < self.gamma:  # a shallower step: the estimator's columns past k stay unlabelled (censored)
            feats = torch.cat([feats, feats.new_zeros(feats.shape[0], self.gamma - k, feats.shape[2])], 1)
        self._features = feats  # the inputs of this step's labels (`observe`)
        return self.estimator.predict(feats)[:, :k]

    def plan(self, confidence_logits: Tensor, slots: Tensor, generations: Tensor,
             prepass: Callable[[], AcceptResult] | None = None) -> PolicyPlan:
        p = self.planner.plan(confidence_logits, slots, generations)
        self._decided = None  # the lag ring holds new survival
        self._pending_cost = None if self._catch_up else (True, p.decision.step_seconds)
        self._catch_up = False
        if self.planner.ring is not None:
            host_slots = slots.cpu()
            self._unseen[host_slots] = (self._unseen[host_slots] - 1).clamp(min=0)
        if self.plain_seconds is not None and self.feedback_decay is not None:
            self._pending = p  # read in `observe`, after the step's commit sync: no device read mid-step
        return PolicyPlan(p.verify_lens, survival=p.survival, layout=p.layout, budget=p.budget)

    def admit(self, slots: Tensor) -> None:
        """New requests took `slots` (host ids; continuous batching): mark them new (no survival of their
        own yet) and re-decide."""
        if self.planner.ring is not None:
            self._unseen[slots] = self.planner.ring.lag
        self._decided = None

    def observe_seconds(self, seconds: float) -> None:
        if self._pending_cost is None or self.cost_window is None:
            self._pending_cost = None
            return
        speculative, predicted = self._pending_cost
        self._pending_cost = None
        samples = self._cost_samples[speculative]
        samples.append(seconds / predicted if predicted > 0 else 1.0)
        if len(samples) >= min(3, samples.maxlen):  # a median of at least three: one stall cannot decide
            ratio = statistics.median(samples)
            if ratio != self.cost_ratio[speculative]:  # the comparison moved: decide again at the next step
                self.cost_ratio[speculative], self._decided = ratio, None

    def observe(self, commit_lens: Tensor, outcome: StepOutcome | None = None) -> None:
        """After a step: host commit lengths [B] of its requests; a speculative `outcome` also labels the
        estimator's features."""
        if self.estimator is not None and outcome is not None and outcome.speculated:
            self.estimator.observe(verify_lens=outcome.caps, correct_lens=outcome.correct_lens, features=self._features)
        if outcome is not None and not outcome.speculated and self.feedback.mean is not None:
            # a plain step observes nothing: its B outcomes count as the long-run mean (the recent average
            # describes text that has moved on), so one bad streak cannot keep a small batch plain
            self.feedback.observe_plain(outcome.requests.numel())
            self._decided = None
        if self._pending is None:
            return
        plan, self._pending = self._pending, None
        # one host read of the planner's own (already checked) lengths and survival
        host = torch.cat([plan.verify_lens[:, None].to(torch.float64), plan.survival.to(torch.float64)], 1).cpu()
        vl = host[:, 0].numpy().astype(np.int64)
        self.feedback.observe_plan(vl, host[:, 1:].numpy(), commit_lens.numpy())
        self._decided = None


class Oracle(Policy):
    """Verify exactly the accepted rows (known from an untimed full-verify prepass)."""

    name = "oracle"

    def __init__(self, gamma: int):
        self.num_drafts = gamma

    def plan(self, confidence_logits: Tensor, slots: Tensor, generations: Tensor,
             prepass: Callable[[], AcceptResult] | None = None) -> PolicyPlan:
        if prepass is None:
            raise ValueError("the oracle plans from a full verify of the step's drafts: pass `prepass`")
        return PolicyPlan(prepass().commit_lens.to(torch.int32))


ADAPTIVE = ("adaptive", "adaptive-est")  # the planner with the head + STS / with the online estimator


def make_policy(name: str, gamma: int, b: int, planner_factory: Callable[[int, bool, int], VerifyPlanner],
                plain_seconds: Callable[[int], float] | None = None, probe: tuple[int, int, bool] = (8, 64, False),
                estimator: OnlineAcceptanceEstimator | None = None, choose_depth: bool = False) -> Policy:
    """The policy named `name` (`fixed-<k>`, `adaptive`, `adaptive-est`, `oracle`) for B = b requests.

    planner_factory(b, sts, depth): a VerifyPlanner for b requests drafting `depth` tokens, with STS
    temperatures when sts; plain_seconds: the profiled plain step (B -> seconds); probe: (probe_every,
    max_probe_every, cost feedback on); estimator: the online estimator `adaptive-est` reads (one instance may
    serve many runs); choose_depth: the adaptive policies also choose the draft depth 1..gamma per step."""
    if name in ADAPTIVE:
        every, most, cost_feedback = probe
        est = estimator if name == "adaptive-est" else None
        depths = {k: planner_factory(b, est is None, k) for k in range(1, gamma)} if choose_depth else None
        return Adaptive(planner_factory(b, est is None, gamma), plain_seconds, every, most,
                        cost_window=9 if cost_feedback else None, estimator=est, depths=depths)
    if name == "oracle":
        return Oracle(gamma)
    if not name.startswith("fixed-") or not name[6:].isdigit():
        raise ValueError(f"unknown policy {name!r}: choose fixed-<k>, adaptive, adaptive-est or oracle")
    return FixedK(int(name[6:]))
