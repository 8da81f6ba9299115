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
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from dspark.calibration.online import OnlineAcceptanceEstimator
from dspark.plan.budget import choose_budget, expected_commit
from dspark.plan.planner import VerifyPlan, VerifyPlanner
from dspark.util.validate import check_type
from dspark.verify.layout import RaggedVerifyLayout


@dataclass
class PolicyPlan:
    """One step's decision: verify lengths [B] int32 (root included) and what the planner saw."""

    verify_lens: Tensor
    survival: Tensor | None = None        # [B, drafts] live calibrated survival (None without drafts)
    layout: RaggedVerifyLayout | None = None  # the planner's layout (tier-padded) when it built one
    budget: int | None = None


class FixedK:
    """Draft k tokens and verify all k (+ the root) for every request."""

    prepass = False

    def __init__(self, k: int):
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"fixed-k needs an int k >= 0, got {k!r}")
        self.num_drafts = k
        self.name = f"fixed-{k}"

    def plan(self, confidence_logits: Tensor, slots: Tensor, generations: Tensor) -> PolicyPlan:
        b = confidence_logits.shape[0]
        lens = torch.full((b,), self.num_drafts + 1, dtype=torch.int32, device=confidence_logits.device)
        return PolicyPlan(lens)


class Adaptive:
    """dspark's VerifyPlanner: budget from lagged calibrated survival and the cost model, live allocation.

    Speculate or not: with `plain_seconds` (B -> seconds of a target-only step, profiled like the
    planner's cost model, which covers the whole speculative step: draft + plan + verify + accept),
    each step first compares the best speculative throughput the planner predicts from the *lagged*
    survival, theta* = max_b tau(b) / T(B, rows(b)), with the plain step's B / T_plain(B). When plain
    wins the decoder runs a target-only step (no draft forward). Plain steps produce no new survival,
    so after `probe_every` plain steps in a row the next step speculates anyway (a probe) to refresh
    the lagged survival. A probe costs a speculative step, so while probes keep confirming plain the
    interval doubles, up to `max_probe_every`; a step that speculates on its merits resets it
    (`max_probe_every = probe_every` probes at a fixed interval). With the realised-cost feedback a probe is
    two speculative steps: the first catches up (not timed, below), the second is timed, so a policy that
    went plain on a profile that overpriced speculation can still find out. The decision reads only survival of
    earlier steps (non-anticipating). One policy object serves one `generate` run (the probe state is
    per run). Without `plain_seconds` every step speculates.

    Realised-acceptance feedback: the lagged survival is the head's view of the *previous* step; with a
    sharp head (the engine's ranks at AUROC ~0.99) it says little about the next one, and at small B one
    request's last step decides the whole batch. After each speculative step the decoder reports the
    committed lengths (`observe`); the policy keeps moving averages of accepted and of verified drafts per
    request per speculative step, counted in request outcomes: a step of B requests is B outcomes, and the
    past keeps weight `feedback_decay` per outcome (`feedback_decay ** B` per step; the default 0.985 is 0.8
    per step at B = 16 and a window of ~70 outcomes at any B: at B = 1 a per-step window of 5 outcomes
    went plain after any short run of rejections, which one request's text produces often). Once it has any,
    the decision predicts a speculative step from them: tau = B (1 + accepted), rows = B (1 + verified),
    theta = tau / T(B, rows), what the planner's steps actually delivered lately. The averages start from
    the calibrated prediction of the first planned step (expected accepted drafts of its allocation),
    worth `prior_weight` request outcomes: one unlucky first outcome must not send the policy plain (it would
    then learn only from rare probes). Only outcomes of earlier steps enter (non-anticipating);
    `feedback_decay=None` keeps the lagged-survival prediction throughout.
    The planner's own budget and allocation are unchanged. With a lag-0 planner (synchronous budget from the
    live survival, right for a decode loop that does not overlap drafting with verification) there is no
    lagged survival: the policy speculates until the first outcome, then decides from the realised averages.

    Continuous batching: a request admitted into a slot (`admit`) has no survival yet, and the lag ring's
    generation guard reads all-ones for it, as good as a perfect draft. With slots refilled every few
    steps that optimism would keep speculation on whatever the others' survival says, so until a new
    request has `lag` survival rows of its own the lagged-survival prediction uses the mean lagged survival
    of the batch's other requests in its place (all-ones only when every request is new).

    Realised-cost feedback: both sides of the decision are profiled once, before serving; when the
    machine's speed drifts afterwards (load, clocks, other tenants) the two predictions can drift apart.
    After each step the decoder reports the step's measured seconds (`observe_seconds`); per kind (plain /
    speculative) the policy keeps the median of the last `cost_window` ratios measured / predicted seconds
    (the planner's T(B, M) of its budget, or T_plain(B)) and, once it has three, divides each side's
    predicted throughput by it. A median, because step times on a shared machine are heavy-tailed: one step
    stalled 5x (or a run's first step, whose draft reads every new prompt) must not flip the decision. The
    first speculative step after plain steps (a probe, or the switch back) is not sampled: its draft first
    catches up on every token the plain steps committed, a cost of having been plain, not of
    speculating, and counting it would keep a policy that once went plain there. (A refilled request's
    prompt is caught up the same way; that one is a steady cost of speculating at all, and is sampled.)
    Every new median re-decides at the next step (also in the middle of a run of plain steps). The planner's
    budget is unchanged (a common scale of T moves no argmax); `cost_window=None` turns this off.

    Without a confidence head: `estimator=OnlineAcceptanceEstimator(gamma)` (dspark.calibration.online) takes
    the head's place. The decoder then skips the head, hands the planner the estimator's confidence logits
    from the draft's draft-vocabulary logits (divided by the sampling temperature when sampling), and after each
    speculative step feeds the estimator that step's accept outcome (verify lengths and correct_len, the
    STS-censored labels) together with the policy's own feedback. The planner must be built with
    `temperatures=None` (the estimator is its own calibration) and the estimator's gamma.
    """

    prepass = False
    name = "adaptive"

    def __init__(self, planner: VerifyPlanner, plain_seconds: Callable[[int], float] | None = None,
                 probe_every: int = 8, max_probe_every: int = 64, feedback_decay: float | None = 0.985,
                 cost_window: int | None = 9, prior_weight: int = 16,
                 estimator: OnlineAcceptanceEstimator | None = None):
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
        self.estimator = estimator
        self.planner = planner
        self.num_drafts = planner.cfg.gamma
        self.plain_seconds = plain_seconds
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
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
        self.realised: tuple[float, float] | None = None  # EMA (accepted, verified) drafts per request per step
        self._prior: tuple[float, float] | None = None  # the first planned step's predicted (accepted, verified)
        self._observed = 0  # request outcomes of speculative steps seen
        self._pending: VerifyPlan | None = None  # the speculative step awaiting its outcome
        self._unseen = torch.zeros(slots, dtype=torch.int64)  # per slot: planned steps until its survival is read

    def speculate(self, slots: Tensor, generations: Tensor) -> bool:
        """Before drafting: True to run a speculative step for these requests, False for a plain one."""
        if self.plain_seconds is None:
            return True
        if self._probe_left:  # a probe's second step: timed for the realised-cost feedback
            self._probe_left -= 1
            return True
        if self._plain_run >= self._interval:  # probe
            self._plain_run = 0
            self._interval = min(2 * self._interval, self.max_probe_every)
            self._probe_left = 0 if self.cost_window is None else 1
            return True
        b = slots.numel()
        if self._decided is None or self._decided[0] != b:
            # same B since the last decision and no admission (`admit`): same requests, same lagged survival
            spec_rate = self._speculative_rate(slots, generations) / self.cost_ratio[True]
            plain_rate = b / (self.plain_seconds(b) * self.cost_ratio[False])
            self._decided = (b, spec_rate > plain_rate)
        if self._decided[1]:
            self._plain_run, self._interval = 0, self.probe_every
            return True
        self._plain_run += 1
        self._pending_cost = (False, self.plain_seconds(b))
        self._catch_up = True
        return False

    def _speculative_rate(self, slots: Tensor, generations: Tensor) -> float:
        """Predicted tokens / s of a speculative step for these requests: from the realised acceptance when
        there is some, else from the lagged survival (planner's best theta)."""
        b = slots.numel()
        if self.realised is not None:
            accepted, verified = self.realised
            rows = min(max(b, round(b * (1 + verified))), b * self.planner.cfg.width)
            return b * (1 + accepted) / float(self.planner.cost_model.seconds_curve(b, rows, 1)[0])
        if self.planner.ring is None:  # lag 0: no earlier survival to read; speculate until outcomes exist
            return math.inf
        lagged = self.planner.ring.read(slots, generations).cpu()
        new = self._unseen[slots.cpu()] > 0
        if new.any() and not new.all():
            lagged[new] = lagged[~new].mean(0)
        return choose_budget(lagged, self.planner.cost_model, self.planner.cfg).theta

    def plan(self, confidence_logits: Tensor, slots: Tensor, generations: Tensor) -> PolicyPlan:
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
        """After any step: its measured seconds (draft + plan + verify + accept, no refill prefill)."""
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

    def observe(self, commit_lens: Tensor) -> None:
        """After a speculative step: host commit lengths [B] of the step's requests (the decoder's sync)."""
        if self._pending is None:
            return
        plan, self._pending = self._pending, None
        vl = plan.verify_lens.cpu().numpy().astype(np.int64)
        if self._prior is None and self.prior_weight:
            expected = expected_commit(plan.survival, plan.verify_lens, self.planner.cfg)
            self._prior = (expected / vl.size - 1, float(vl.sum()) / vl.size - 1)
        accepted = float((np.minimum(commit_lens.numpy(), vl) - 1).mean())  # within the verified rows
        verified = float((vl - 1).mean())
        n = vl.size
        self._observed += n
        # the mean of the prior and the first outcomes, then the moving average
        prior = self.prior_weight if self._prior is not None else 0
        w = max(1 - self.feedback_decay ** n, n / (self._observed + prior))
        old = self.realised if self.realised is not None else (self._prior or (accepted, verified))
        self.realised = ((1 - w) * old[0] + w * accepted, (1 - w) * old[1] + w * verified)
        self._decided = None


class Oracle:
    """Verify exactly the accepted rows (known from an untimed full-verify prepass)."""

    prepass = True
    name = "oracle"

    def __init__(self, gamma: int):
        self.num_drafts = gamma
