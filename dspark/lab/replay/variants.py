"""What calibration, lag and tiers buy: the adaptive policy replayed with one thing changed at a time.

`fit_trace_temperatures` fits STS temperatures on a seeded half of the trace's requests at the positions a decode
loop steps at (labels: the greedy prefix reaches draft k), as the demo's teacher-forced recorder does.
`variant_lab(base, name, B)` gives the lab and policy of each variant in `VARIANTS`: survival from the head after
STS (the default) or before it, temperatures mis-set x0.5 / x2, one uniform survival per position for every request,
the online estimator, the oracle's exact acceptance, the adaptive policy given the oracle's knowledge as its
survival (the planner's own loss, with nothing left to estimate); the oracle drafting only for the requests whose
first draft the target accepts (the most per-request speculation adds); the policy drafting gamma at every
speculative step (no depth choice); the planner's lag 1 / 2 (default 0); at lag 0 the greedy early-stop scan in
place of the argmax over live survival (what a sampling run must use, "lag-0 scan"); eager steps (no graph tiers);
the gate without its measured-cost feedback, without the catch-up price, probing the whole batch every time (no
partial probes), or never probing; each step's `observe` deferred until the next step's forward is launched
(`Engine.defer_observe`: decisions from outcomes one step old); and the policy's host work priced at 0.25 ms per
speculative step (what its hooks take per step on the lab's 2-core CPU beyond a fixed k's, less the ragged layout a
fixed k builds in its verify phase too, `perf/policy_overhead.py`; the cost models price the device only), in the
plan phase of a synchronous loop or, with its `observe` / `observe_seconds` (0.09 ms of it) deferred, 0.16 ms there
and 0.09 ms overlapping the next step's forward (modelled, not measured on a GPU).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from dspark.calibration.fit import fit_temperatures
from dspark.lab.replay.lab import Lab, serving_queue
from dspark.lab.replay.trace import Trace
from dspark.serve.drafters.base import Drafts
from dspark.serve.policies import Adaptive, Oracle, Policy, PolicyPlan
from dspark.util.validate import check_int, check_type
from dspark.verify.accept import AcceptResult

if TYPE_CHECKING:
    from dspark.serve.outcome import StepOutcome

VARIANTS = ("head+STS", "head raw", "temps x0.5", "temps x2", "uniform", "estimator", "oracle", "oracle survival",
            "per-request oracle", "fixed depth", "lag 1", "lag 2", "lag-0 scan", "no tiers", "no cost feedback",
            "no catch-up price", "whole-batch probes", "no probes", "observe deferred", "host 0.25 ms",
            "host 0.25 ms deferred")
NEVER = 10 ** 9  # plain steps before a probe in the variant "no probes": more than any run takes
HOST_SECONDS = 2.5e-4  # "host 0.25 ms": adaptive's host work per step beyond a fixed k's (policy_overhead.py)
DEFERRED_SECONDS = 9e-5  # of it, its `observe` / `observe_seconds` hooks'
SURE = 30.0  # |logit| of a known outcome: sigmoid(30) rounds to 1 in float32, sigmoid(-30) is 9e-14


def step_rows(trace: Trace, gamma: int, requests: Tensor) -> Tensor:
    """The trace rows a fixed-gamma greedy run of `requests` steps at (t = 0, then t += min(a(t), gamma) + 1):
    the positions a decode loop visits, where acceptance is lower than over all positions (a hard stretch is
    visited at every token, an easy one skipped)."""
    rows = []
    for i in requests.tolist():
        start, end = int(trace.position_offsets[i]), int(trace.position_offsets[i + 1])
        t = start
        while t < end:
            rows.append(t)
            t += min(int(trace.accepted[t]), gamma) + 1
    return torch.tensor(rows, dtype=torch.int64)


def trace_labels(trace: Trace, gamma: int, requests: Tensor) -> tuple[Tensor, Tensor]:
    """(confidence logits [n, gamma], greedy prefix labels [n, gamma]) at the step positions of `requests`."""
    rows = step_rows(trace, gamma, requests)
    labels = (trace.accepted[rows, None] > torch.arange(gamma)[None, :]).to(torch.float32)
    return trace.confidence_logits[rows, :gamma], labels


def fit_trace_temperatures(trace: Trace, gamma: int, seed: int = 0) -> tuple[list[float], dict]:
    """STS temperatures [gamma] fitted on a seeded half of the requests, and what the fit saw per position."""
    check_type("trace", trace, Trace)
    if not 1 <= check_int("gamma", gamma, 1) <= trace.gamma:
        raise ValueError(f"gamma must be in [1, {trace.gamma}] (the trace's recorded drafts), got {gamma}")
    check_int("seed", seed, 0)
    half = torch.randperm(trace.num_requests, generator=torch.Generator().manual_seed(seed))[: trace.num_requests // 2]
    logits, labels = trace_labels(trace, gamma, half.sort().values)
    fits = fit_temperatures(logits, labels)
    return [f.temperature for f in fits], {"requests": int(half.numel()), "rows": int(logits.shape[0]),
                                           "at_bound": [f.at_bound for f in fits]}


def mean_conditional_logits(trace: Trace, gamma: int) -> Tensor:
    """logit of the mean conditional acceptance per position [gamma] over the whole trace (uniform survival)."""
    _, labels = trace_labels(trace, gamma, torch.arange(trace.num_requests))
    reached = torch.cat([torch.ones(labels.shape[0], 1), labels[:, :-1]], 1)
    c = (labels.sum(0) / reached.sum(0).clamp(min=1)).clamp(1e-4, 1 - 1e-4)
    return torch.log(c / (1 - c)).to(torch.float32)


class UniformConfidence(Adaptive):
    """The adaptive policy with one confidence logit per position for every request (`logits` [gamma])."""

    def __init__(self, logits: Tensor, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.logits = logits

    def confidence(self, drafts: Drafts) -> Tensor:
        b, k = drafts.tokens.shape
        return self.logits[:k].expand(b, k).clone()


class OracleSurvival(Adaptive):
    """The adaptive policy whose survival is the step's own outcome: 1 for the drafts the target accepts, 0
    after (read from the untimed full-verify prepass the oracle plans from). Needs a planner without
    temperatures."""

    def plan(self, confidence_logits: Tensor, slots: Tensor, generations: Tensor,
             prepass: Callable[[], AcceptResult] | None = None) -> PolicyPlan:
        if prepass is None:
            raise ValueError("oracle survival reads a full verify of the step's drafts: pass `prepass`")
        accepted = prepass().commit_lens.to(torch.int64) - 1
        k = torch.arange(confidence_logits.shape[1], device=confidence_logits.device)
        logits = torch.where(k[None, :] < accepted[:, None], SURE, -SURE).to(confidence_logits.dtype)
        return super().plan(logits, slots, generations, prepass)


class PerRequestOracle(Oracle):
    """The oracle drafting only for the requests whose first draft the target accepts, read from the trace before
    the step drafts (the rest decode plain in the same forward). trace / ids [N]: the trace and the queue a run
    serves (requests are admitted in queue order)."""

    name = "per-request oracle"

    def __init__(self, trace: Trace, ids: Tensor, gamma: int):
        super().__init__(gamma)
        self.trace, self.ids = trace, ids
        self._admitted = 0  # queue requests admitted so far
        self._request: dict[int, int] = {}  # slot -> its trace request
        self._t: dict[int, int] = {}  # slot -> tokens committed past its prompt

    def admit(self, slots: Tensor) -> None:
        for i, s in enumerate(slots.tolist()):
            self._request[s], self._t[s] = int(self.ids[self._admitted + i]), 0
        self._admitted += slots.numel()

    def speculate(self, slots: Tensor, generations: Tensor) -> bool:
        host = slots.cpu().tolist()
        requests = torch.tensor([self._request[s] for s in host])
        self.drafting = self.trace._block(requests, torch.tensor([self._t[s] for s in host])).accepted >= 1
        return True

    def observe(self, commit_lens: Tensor, outcome: StepOutcome | None = None) -> None:
        for s, c in zip(outcome.requests.tolist(), commit_lens.tolist()):
            self._t[s] += c


def variant_lab(base: Lab, name: str, b: int, ids: Tensor | None = None) -> tuple[Lab, str | Policy]:
    """The lab and the policy (a name or an object) of variant `name` at B = b; ids [N]: the queue the run will
    serve (default `serving_queue(trace, b).ids`; read by "per-request oracle")."""
    check_type("base", base, Lab)
    check_int("b", b, 1)
    replace = dataclasses.replace
    temps = None if base.temperatures is None else list(base.temperatures)
    simple = {"head+STS": (base, "adaptive"), "head raw": (replace(base, temperatures=None), "adaptive"),
              "estimator": (base, "adaptive-est"), "oracle": (base, "oracle"),
              "fixed depth": (replace(base, choose_depth=False), "adaptive"),
              "lag 1": (replace(base, lag=1), "adaptive"), "lag 2": (replace(base, lag=2), "adaptive"),
              "lag-0 scan": (replace(base, live_argmax=False), "adaptive"),
              "no tiers": (replace(base, tiers=False), "adaptive"),
              "no cost feedback": (replace(base, probe=(*base.probe[:2], False)), "adaptive"),
              "no catch-up price": (replace(base, price_catch_up=False), "adaptive"),
              "whole-batch probes": (replace(base, probe_requests=None), "adaptive"),
              "no probes": (replace(base, probe=(NEVER, NEVER, base.probe[2])), "adaptive"),
              "observe deferred": (replace(base, defer_observe=True), "adaptive"),
              "host 0.25 ms": (replace(base, host_seconds=HOST_SECONDS), "adaptive"),
              "host 0.25 ms deferred": (replace(base, host_seconds=HOST_SECONDS - DEFERRED_SECONDS, defer_observe=True,
                                                deferred_host_seconds=DEFERRED_SECONDS), "adaptive")}
    if name in simple:
        return simple[name]
    if name in ("temps x0.5", "temps x2"):
        if temps is None:
            raise ValueError(f"variant {name!r} scales the lab's temperatures, but it has none")
        scale = 0.5 if name == "temps x0.5" else 2.0
        return replace(base, temperatures=[t * scale for t in temps]), "adaptive"
    if name == "per-request oracle":
        ids = serving_queue(base.trace, b).ids if ids is None else ids
        return base, PerRequestOracle(base.trace, ids, base.gamma)
    if name in ("uniform", "oracle survival"):
        lab = replace(base, temperatures=None)
        args = (lab.planner(b, False), lab.cost.believed_plain(lab.context), lab.gate)
        if name == "uniform":
            return lab, UniformConfidence(mean_conditional_logits(base.trace, base.gamma), *args)
        return lab, OracleSurvival(*args)
    raise ValueError(f"unknown variant {name!r}; choose one of {VARIANTS}")
