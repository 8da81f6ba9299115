"""Replay a trace through the engine's own scheduler, step and policies (`Lab.run`).

A `Lab` holds what every run of one study shares: the trace, the serving cost model (the policy's planner
and the simulated target read the same one, or `reality=` plays the simulator with another), the STS
temperatures and the planner settings. `run(name, B)` serves a queue of the trace's requests on B slots with
the named policy (`dspark.serve.policies.base.make_policy`, as the demo builds them) and returns the engine's
own `GenerateResult`, its step times in simulated seconds. Same trace, cost model and settings give the
same result bit for bit. `run(name, B, ids, timed=TimedReplay(...))` takes the same steps with their time
measured on a device's models instead (`dspark.lab.replay.timed`).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from dspark.calibration.online import OnlineAcceptanceEstimator
from dspark.config import ScheduleConfig, VerifyMode
from dspark.cost.serving import ServingCost
from dspark.lab.replay.sim import SimClock, SimTarget, TraceDrafter
from dspark.lab.replay.timed import TimedReplay
from dspark.lab.replay.trace import Trace
from dspark.plan.planner import PlannerSettings, VerifyPlanner
from dspark.serve.outcome import GenerateResult, finish
from dspark.serve.policies import Policy, make_policy
from dspark.serve.policies.gate import GateSettings
from dspark.serve.scheduler import Batch, Scheduler
from dspark.serve.step import Engine, serve
from dspark.serve.tier_step import graph_slot_count
from dspark.util.validate import check_int, check_real, check_type

REQUESTS_PER_SLOT = 8  # measured requests per slot
FILL_PER_SLOT = 4  # requests per slot queued after the measured ones: every measured request runs at full concurrency
MAX_REPEATS = 8  # the most times one trace request may appear in a recycled queue
# the gate without its measured-cost feedback and probe budget: decisions read no step time, so a live or
# timed run takes the replay's steps one for one (perf/replay_live.py, the timed replay); the lab's default is
# the library's gate
UNTIMED_PROBE = (8, 64, False)
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's largest


def queue_ids(trace: Trace, n: int, *, seed: int = 0, max_repeats: int = MAX_REPEATS) -> Tensor:
    """n trace requests [n] in arrival order: seeded permutations of the whole trace one after another (seed,
    seed + 1, ...), cut at n, so the kinds stay mixed and a request repeats only once every other request has
    been queued (under greedy decoding a repeat is the same request again). ValueError when n needs a request
    more than `max_repeats` times."""
    check_type("trace", trace, Trace)
    check_int("n", n, 1)
    check_int("max_repeats", max_repeats, 1)
    repeats = -(-n // trace.num_requests)
    if repeats > max_repeats:
        raise ValueError(f"a queue of {n} requests needs {repeats} copies of each of the trace's {trace.num_requests}, "
                         f"past max_repeats = {max_repeats}: record a larger trace (python -m dspark.lab.replay.record "
                         f"--requests {-(-n // max_repeats)}), lower B or the requests per slot, or raise max_repeats")
    if check_int("seed", seed, 0) > MAX_SEED - repeats + 1:
        raise ValueError(f"seed must be in [0, {MAX_SEED - repeats + 1}] (this queue seeds seed .. seed + "
                         f"{repeats - 1}), got {seed}")
    perms = [torch.randperm(trace.num_requests, generator=torch.Generator().manual_seed(seed + i))
             for i in range(repeats)]
    return torch.cat(perms)[:n]


@dataclass(frozen=True)
class ServingQueue:
    """A queue for a fixed-concurrency run: trace requests `ids` [N] in arrival order and the queue positions
    `measured` whose requests the throughput and the time per output token count."""

    ids: Tensor
    measured: range


def serving_queue(trace: Trace, slots: int, *, requests_per_slot: int = REQUESTS_PER_SLOT,
                  fill_per_slot: int = FILL_PER_SLOT, min_requests: int = 64, seed: int = 0,
                  max_repeats: int = MAX_REPEATS) -> ServingQueue:
    """The queue a run on `slots` slots serves: a first wave of `slots` requests (all admitted at once, not
    measured), M = max(min_requests, requests_per_slot x slots) measured requests, then fill_per_slot x slots
    more that keep every slot busy until the measured ones finish (not measured)."""
    check_int("slots", slots, 1)
    check_int("requests_per_slot", requests_per_slot, 1)
    check_int("fill_per_slot", fill_per_slot, 0)
    check_int("min_requests", min_requests, 1)
    m = max(min_requests, requests_per_slot * slots)
    ids = queue_ids(trace, slots + m + fill_per_slot * slots, seed=seed, max_repeats=max_repeats)
    return ServingQueue(ids, range(slots, slots + m))


def check_queue(trace: Trace, ids: Tensor) -> Tensor:
    """`ids` [N] int64 trace requests (a queue handed in): ValueError naming the first one the trace lacks."""
    check_type("ids", ids, Tensor)
    if ids.ndim != 1 or ids.numel() == 0 or ids.dtype != torch.int64:
        raise ValueError(f"ids must be a non-empty 1-D int64 tensor of trace requests, got shape {list(ids.shape)} "
                         f"dtype {ids.dtype}")
    bad = ((ids < 0) | (ids >= trace.num_requests)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"ids[{i}] = {int(ids[i])} is not a request of the trace "
                         f"(it holds 0..{trace.num_requests - 1})")
    return ids


def mean_context(trace: Trace) -> float:
    """Mean KV tokens a request holds at a decode position of the trace: prompt - 1 + t over every recorded
    position t of every request (what a server profiling at its typical context would assume)."""
    check_type("trace", trace, Trace)
    prompts = trace.prompt_offsets.diff().to(torch.float64)
    n = trace.new_tokens.to(torch.float64)
    return float(((prompts - 1) * n + n * (n - 1) / 2).sum() / n.sum())


@dataclass
class Lab:
    """One study's shared setup. gamma: drafts per step of the budget policies (<= trace.gamma);
    temperatures: STS temperatures [gamma] (None: raw head logits); lag: the planner's lag; tiers: use the cost
    model's graph tiers (False: eager, every row priced as is); reality: the cost model the simulated target
    runs on (default `cost`, what the policies believe); context: the KV tokens per request the policies'
    cost beliefs assume (None: the trace's `mean_context`); the simulated target prices each request's own;
    choose_depth: the adaptive policies choose the draft depth per step (lag 0 only); probe: the adaptive
    gate's (probe_every, max_probe_every, cost feedback), `GateSettings.probing` (default: the library's
    `GateSettings()`; `UNTIMED_PROBE` where a live or timed run must take the same steps); price_catch_up: the
    gate charges the drafter's catch-up of accepted drafts at the cost's `per_catch_up_token` (False: free);
    probe_requests: the gate's requests per partial probe (None: every probe drafts for the whole batch);
    fold_prefill: admitted prompts ride the next step's forward while other requests decode (`Engine`; False:
    a prefill forward of their own, in which case the admitted requests decode in the same step); None (the
    default): fold where the charged serving cost prices a prefill forward of its own (`prefill.per_forward` >
    0), as dspark's engine on the CPU; a cost with no per-forward price models chunked prefill that decodes
    the admitted request in the same step already (vLLM's), which folding would only delay by a step;
    host_seconds: seconds added to each speculative step's plan phase for the policy's host work (its speculate,
    plan and observe hooks; plain steps, whose hooks do less, are not charged; the gate's cost feedback sees it,
    as it sees a live plan phase; a timed replay measures its own instead; 0: unpriced, as the cost models price
    the device only); defer_observe: the policy observes each step once the next step's forward is launched
    (`Engine.defer_observe`, as the live engine does on an accelerator; off by default, so that a priced and a
    timed replay take the same steps, and a timed replay's drafter waits for its device anyway);
    deferred_host_seconds: with it, the price of the `observe` deferred after a speculative step, run while the
    next forward runs (that phase lasts the longer of the two; `host_seconds` then prices the rest);
    live_argmax: at lag 0 the planners choose the budget by the argmax over live survival
    (`PlannerSettings.live_argmax`: a replay decodes greedily, where that is lossless, as the demo's adaptive
    policies do); False: the greedy early-stop scan a sampling run needs."""

    trace: Trace
    cost: ServingCost
    gamma: int
    temperatures: Sequence[float] | None = None
    lag: int = 0
    tiers: bool = True
    reality: ServingCost | None = None
    probe: tuple[int, int, bool] = (8, 64, True)
    estimators: dict[int, OnlineAcceptanceEstimator] = field(default_factory=dict)
    context: float | None = None
    choose_depth: bool = True
    price_catch_up: bool = True
    probe_requests: int | None = 16
    fold_prefill: bool | None = None
    host_seconds: float = 0.0
    defer_observe: bool = False
    deferred_host_seconds: float = 0.0
    live_argmax: bool = True

    def __post_init__(self) -> None:
        check_type("trace", self.trace, Trace)
        check_real("host_seconds", self.host_seconds, 0.0, math.inf, high_open=True)
        for flag in ("tiers", "choose_depth", "price_catch_up", "defer_observe", "live_argmax"):
            check_type(flag, getattr(self, flag), bool)
        check_int("lag", self.lag, 0)
        check_type("reality", self.reality, ServingCost, optional=True)
        check_type("estimators", self.estimators, dict)
        if self.context is not None:
            check_real("context", self.context, 0.0, math.inf, high_open=True)
        check_real("deferred_host_seconds", self.deferred_host_seconds, 0.0, math.inf, high_open=True)
        if self.deferred_host_seconds and not self.defer_observe:
            raise ValueError(f"deferred_host_seconds = {self.deferred_host_seconds} prices the hooks "
                             f"defer_observe=True defers, got defer_observe={self.defer_observe}")
        check_type("cost", self.cost, ServingCost)
        check_type("fold_prefill", self.fold_prefill, bool, optional=True)
        check_int("gamma", self.gamma, 1)
        if self.gamma > self.trace.gamma:
            raise ValueError(f"gamma = {self.gamma} exceeds the trace's recorded block of {self.trace.gamma} drafts")
        if self.cost.width != self.gamma + 1:
            raise ValueError(f"the cost model {self.cost.name!r} prices verify width W = {self.cost.width} but the "
                             f"policies verify W = gamma + 1 = {self.gamma + 1}: load it with width={self.gamma + 1}")
        for which, cost in (("cost", self.cost), ("reality", self.reality)):
            measured = None if cost is None else cost.parameters.get("draft_sha256")
            if measured is not None and measured != self.trace.meta.get("draft_sha256"):
                raise ValueError(f"{which} {cost.name!r} was profiled with the draft of sha256 {measured}, but the "
                                 f"trace was recorded with {self.trace.meta.get('draft_sha256')}: profile the pair the "
                                 "trace was recorded with (or record a trace with this draft)")
        if self.reality is not None and self.reality.width != self.cost.width:
            raise ValueError(f"reality's width {self.reality.width} differs from the cost model's {self.cost.width}")
        if self.temperatures is not None:
            given = check_type("temperatures", self.temperatures, (list, tuple, Tensor, np.ndarray))
            if isinstance(given, (Tensor, np.ndarray)) and given.ndim != 1:
                raise ValueError(f"temperatures must be 1-D [gamma], got shape {tuple(given.shape)}")
            temps = list(given)
            if len(temps) < self.gamma:
                raise ValueError(f"temperatures must hold gamma = {self.gamma} values, got {temps}")
            for i, t in enumerate(temps):
                check_real(f"temperatures[{i}]", float(t) if isinstance(t, (Tensor, np.number)) else t, 0.0,
                           math.inf, low_open=True, high_open=True)
        if self.context is None:
            self.context = mean_context(self.trace)
        _ = self.gate  # bad probe settings refused now, not at the first adaptive run

    def _check_batch(self, b: int, simulated: bool = False) -> None:
        """b in [1, the batch sizes the cost model prices] (and `reality`'s, when it plays the simulator)."""
        limit, by = self.cost.max_requests, self.cost
        if simulated and self.reality is not None and self.reality.max_requests < limit:
            limit, by = self.reality.max_requests, self.reality
        if check_int("b", b, 1) > limit:
            role = "reality" if by is not self.cost else "cost"
            raise ValueError(f"b must be in [1, max_requests = {limit}] (the batch sizes {role} {by.name!r} "
                             f"prices), got {b}")

    @property
    def graph_tiers(self) -> tuple[int, ...]:
        return self.cost.tiers if self.tiers else ()

    def planner(self, b: int, sts: bool = True, depth: int | None = None) -> VerifyPlanner:
        """The VerifyPlanner for B = b requests drafting `depth` tokens (default gamma), its cost model the
        serving cost's belief at that depth and the lab's context (STS temperatures when `sts` and the lab has
        them)."""
        depth = self.gamma if depth is None else depth
        tiers, w = self.graph_tiers, depth + 1
        temps = None if self.temperatures is None or not sts else list(self.temperatures)[:depth]
        planning = PlannerSettings(lag=self.lag, num_slots=b, tiers=tiers or None,
                                   graph_slots=graph_slot_count(b, tiers, w) if tiers else None,
                                   live_argmax=self.live_argmax and self.lag == 0)
        return VerifyPlanner(ScheduleConfig(gamma=depth), self.cost.believed(depth, self.context), planning,
                             temperatures=temps)

    @property
    def gate(self) -> GateSettings:
        """The adaptive policies' gate: the lab's probe schedule, the drafter's catch-up priced as believed."""
        return GateSettings.probing(self.probe, self.cost.drafter.per_catch_up_token if self.price_catch_up else 0.0,
                                    self.probe_requests, self.cost.prefill.per_token)

    def policy(self, name: str, b: int) -> Policy:
        """The named policy for B = b; `adaptive-est` gets a fresh online estimator per B (it then learns over
        that B's run as a server's would)."""
        self._check_batch(b)
        est = self.estimators.setdefault(b, OnlineAcceptanceEstimator(self.gamma)) if name == "adaptive-est" else None
        return make_policy(name, self.gamma, functools.partial(self.planner, b), self.cost.believed_plain(self.context),
                           self.gate, est, choose_depth=self.choose_depth and self.lag == 0)

    def run(self, policy: str | Policy, b: int, ids: Tensor | None = None, mode: VerifyMode = VerifyMode.COMPACT,
            timed: TimedReplay | None = None) -> GenerateResult:
        """Serve the trace requests `ids` [N] (default `serving_queue(trace, b).ids`) on b slots with `policy`
        (a name, or a policy object built for this lab). timed: run every step on that device's models and time
        it with the wall clock (`dspark.lab.replay.timed`; `reality` sets only the default `fold_prefill`, as in
        the priced run), the same outcomes step for step."""
        self._check_batch(b, simulated=timed is None)
        ids = serving_queue(self.trace, b).ids if ids is None else check_queue(self.trace, ids)
        check_type("mode", mode, VerifyMode)
        check_type("timed", timed, TimedReplay, optional=True)
        pol = self.policy(policy, b) if isinstance(policy, str) else check_type("policy", policy, Policy)
        if pol.num_drafts > self.gamma:
            raise ValueError(f"policy {pol.name!r} drafts {pol.num_drafts} tokens, past the lab's gamma = "
                             f"{self.gamma} (its serving cost prices depths 1..{self.cost.drafter.max_drafts})")
        prompts = [self.trace.prompt(int(i)) for i in ids]
        new_tokens = self.trace.new_tokens[ids].to(torch.int64)
        w = pol.num_drafts + 1
        longest = max(p.numel() + int(n) for p, n in zip(prompts, new_tokens))
        slots = min(b, len(prompts))
        if timed is None:
            clock, reality, device = SimClock(), self.reality or self.cost, torch.device("cpu")
            target = SimTarget(self.trace, ids, reality, clock, self.graph_tiers)
            engine = Engine(TraceDrafter(self.trace, ids, reality, clock), target, clock.now, lambda: None)
        else:
            engine = timed.engine(self.trace, ids, slots=slots, max_len=longest + w, tiers=self.graph_tiers)
            device = timed.device
        if pol.num_drafts > engine.drafter.max_drafts:
            raise ValueError(f"policy {pol.name!r} drafts {pol.num_drafts} tokens but the trace recorded "
                             f"{self.trace.gamma} (its drafter proposes at most {engine.drafter.max_drafts})")
        scheduler = Scheduler(prompts, new_tokens, None, itertools.count(1), device)
        batch = Batch.empty(slots, longest + w, device)
        fold = self.fold_prefill
        if fold is None:
            fold = (self.reality or self.cost).prefill.per_forward > 0
        # a timed replay measures its host work
        host, deferred = (self.host_seconds, self.deferred_host_seconds) if timed is None else (0.0, 0.0)
        engine = dataclasses.replace(engine, mode=mode, fold_prefill=fold, host_seconds=host,
                                     defer_observe=self.defer_observe, deferred_host_seconds=deferred)
        return finish(serve(engine, scheduler, batch, pol, max_rows=longest + w))
