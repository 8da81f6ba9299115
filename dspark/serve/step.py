"""One decode step and the run loop around it, over the declared plug-in points.

    drafts  = drafter.propose(batch, slots, k, ...)          # Drafter: block draft | trace | ...
    conf    = policy.confidence(drafts)                       # the head's logits, or the estimator's
    plan    = policy.plan(conf, slots, generations, prepass)  # Policy: fixed-k | adaptive | oracle
    checked = target.verify(batch, slots, drafts, plan...)    # Target: live model | simulated
    result  = target.accept(checked, drafts, sampling)        # greedy / rejection sampling, capped
    batch.commit(...); policy.observe(...)                    # defer_observe: once the next step's forward
                                                              # is launched, the host busy while the device runs

`serve` is the run: retire finished requests, admit queued ones into free slots (prefilled by the target,
in a forward of their own or folded into the step's while other requests decode; caught up by the drafter at
its next proposal), step, until the queue is drained. The live engine
(`SpecDecoder`) and the trace replay (`dspark.lab.replay`) both run `serve`; only the drafter, the target and
the clock differ. Phase times come from `clock` (wall, thread CPU time, or a replay's simulated clock).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from dspark.config import VerifyMode
from dspark.serve.checks import check_drafting
from dspark.serve.config import GREEDY
from dspark.serve.drafters.base import Drafter
from dspark.serve.outcome import DecodeRun, GenerateResult, StepOutcome, StepTimes
from dspark.serve.policies.base import Policy, PolicyPlan
from dspark.serve.runner import Target
from dspark.serve.sampling import Sampling
from dspark.serve.scheduler import Batch, Scheduler
from dspark.verify import boundary
from dspark.verify.accept import AcceptResult
from dspark.verify.layout import RaggedVerifyLayout


@dataclass
class Engine:
    """What a run is driven by: the plug-in points, how it is timed and synchronised, how it verifies and draws."""

    drafter: Drafter
    target: Target
    clock: Callable[[], float]
    sync: Callable[[], None]  # wait for the device at the end of a timed phase
    sampling: Sampling = field(default_factory=lambda: Sampling.seeded(GREEDY, torch.device("cpu")))
    mode: VerifyMode = VerifyMode.COMPACT
    keep_draft_logits: bool = False  # each speculative StepOutcome keeps the drafter's [B, k, V] token logits
    fold_prefill: bool = True  # admitted prompts ride the next step's target forward when others decode in it
    host_seconds: float = 0.0  # a replay's price of the policy's host work per speculative step (live: measured)
    # a step's `observe` / `observe_seconds` wait until the next step's forward is launched (the host works while
    # the device drafts; their clock time falls in that step's draft, or plain forward, phase), for a policy whose
    # `observe_deferrable` allows it; it then decides each step from outcomes and times one step old
    defer_observe: bool = False
    deferred_host_seconds: float = 0.0  # a replay's price of an `observe` deferred after a speculative step (live: 0)


Launched = Callable[[], float]  # run the held step's `observe` now that a forward is launched; a replay's price of it


def plain_step(engine: Engine, batch: Batch, slots: Tensor, stop_ids: Tensor | None, plan_seconds: float,
               launched: Launched) -> tuple[StepOutcome, Tensor]:
    """Target-only decoding (fixed-0, or a policy's choice that took `plan_seconds`): one row per request;
    `launched` runs once the forward is launched. Returns the outcome and the host commit lengths."""
    b, dev = slots.numel(), batch.tokens.device
    now = engine.clock
    t0 = now()
    layout = RaggedVerifyLayout._from_lens(torch.ones(b, dtype=torch.int32), (), None, 1, total_rows=b, host=True)
    layout = layout.to(dev)
    token = engine.target.plain(batch, slots, layout, engine.sampling)
    overlapped = launched()
    t1 = now()
    ones = torch.ones(b, dtype=torch.int32, device=dev)
    commit = batch.commit(slots, token, ones, stop_ids)
    engine.sync()
    times = StepTimes(plan=plan_seconds, verify=max(t1 - t0, overlapped), accept=now() - t1)
    out = StepOutcome(requests=slots, plan=PolicyPlan(ones), layout=layout, caps=ones,
                      confidence_logits=torch.zeros(b, 0, device=dev), commit_lens=ones, correct_lens=ones - 1,
                      times=times, host_syncs=0)
    return out, commit


def speculative_step(engine: Engine, batch: Batch, slots: Tensor, policy: Policy, stop_ids: Tensor | None,
                     plan_seconds: float, launched: Launched) -> tuple[StepOutcome, Tensor]:
    """Draft, plan, verify, accept and commit for the requests in `slots` (host ids, ascending); the requests
    `policy.drafting` leaves out verify their root only; `launched` runs once the draft is launched."""
    now, target, k, sampling = engine.clock, engine.target, policy.num_drafts, engine.sampling
    b, dev = slots.numel(), batch.tokens.device
    rows = None if policy.drafting is None else policy.drafting.nonzero().squeeze(1)  # host positions that draft
    times = StepTimes(plan=plan_seconds)
    t0 = now()
    drafts = engine.drafter.propose(batch, slots if rows is None else slots[rows], k, policy.source, sampling)
    if rows is not None:
        drafts = drafts.spread(boundary.to_device(rows, dev), b)
    overlapped = launched()  # before `confidence`: an estimator's features are still the held step's
    t1 = now()
    times.draft = max(t1 - t0, overlapped)
    conf = policy.confidence(drafts)
    if rows is not None:  # an estimator's confidence of a request that did not draft: none
        conf = conf.masked_fill(boundary.to_device(~policy.drafting, dev)[:, None], -math.inf)
    prepassed: list[AcceptResult] = []
    untimed = [0.0]

    def prepass() -> AcceptResult:  # a full static verify outside the step's time (the oracle's hook)
        u = now()
        full = torch.full((b,), k + 1, dtype=torch.int32, device=dev)
        with target.unfolded():  # the folded prompts ride the step's own (timed) forward
            verified = target.verify(batch, slots, drafts, full, VerifyMode.STATIC, None)
        prepassed.append(target.accept(verified, drafts, sampling))
        untimed[0] += now() - u
        return prepassed[-1]

    host_t0 = time.perf_counter()
    dev_slots = boundary.to_device(slots, batch.tokens.device)
    plan = policy.plan(conf, dev_slots, batch.generations[dev_slots], prepass=prepass)
    times.host_plan = time.perf_counter() - host_t0
    t2 = now()
    times.plan += t2 - t1 - untimed[0] + engine.host_seconds
    checked = target.verify(batch, slots, drafts, plan.verify_lens, engine.mode, plan.layout)
    t3 = now()
    acc = target.accept(checked, drafts, sampling)
    if prepassed:
        acc = prepassed[0]  # sampling: the outcome the prepass drew (greedy: identical anyway)
    t4 = now()
    times.verify, times.accept = t3 - t2, t4 - t3
    commit = batch.commit(slots, acc.tokens, acc.commit_lens, stop_ids)
    engine.sync()
    times.accept += now() - t4
    out = StepOutcome(requests=slots, plan=plan, layout=checked.layout, caps=checked.caps, confidence_logits=conf,
                      commit_lens=acc.commit_lens, correct_lens=acc.correct_lens, times=times, host_syncs=1,
                      draft_logits=drafts.logits if engine.keep_draft_logits else None, catch_up=drafts.catch_up,
                      drafting=b if rows is None else rows.numel())
    return out, commit


def _observe_seconds(policy: Policy, out: StepOutcome) -> None:
    """The step's measured seconds for the policy's cost feedback (a folded prompt's tokens rode its forward)."""
    policy.observe_seconds(out.times.draft + out.times.plan + out.times.verify + out.times.accept,
                           out.prefill_tokens if out.prefill_folded else 0)


@torch.no_grad()
def serve(engine: Engine, scheduler: Scheduler, batch: Batch, policy: Policy, *, max_rows: int) -> DecodeRun:
    """Run the scheduler's queue to its end on `batch`'s slots with one policy; yields each StepOutcome and
    returns the GenerateResult. The target prepares a verify step for each of `policy.draft_depths` before the
    first step; max_rows: the most rows one request adds to a prefill or draft catch-up forward."""
    drafter, target, now = engine.drafter, engine.target, engine.clock
    stop_ids = scheduler.stop_ids
    result = GenerateResult(tokens=scheduler.result.tokens)
    prefill, prefill_tokens = 0.0, 0
    held: list[tuple[Tensor, StepOutcome]] = []  # `defer_observe`: the last step, observed once the next launches
    defer = engine.defer_observe and policy.observe_deferrable

    def launched() -> float:
        if not held:
            return 0.0
        commit, out = held.pop()
        policy.observe(commit, out)
        _observe_seconds(policy, out)
        return engine.deferred_host_seconds if out.speculated else 0.0

    target.start(batch, tuple(d + 1 for d in policy.draft_depths), max_rows)
    try:
        drafter.start(batch, max_rows)
        while True:
            scheduler.retire(batch)
            t0 = now()
            admitted = scheduler.admit(batch)
            folded = admitted[:0]
            if admitted.numel():
                # chunked prefill: while other requests decode, the prompts ride their step's forward and the
                # admitted requests decode from the next step; else they get a forward of their own now
                if engine.fold_prefill and int((batch.owners >= 0).sum()) > admitted.numel():
                    target.fold(batch, admitted)
                    folded = admitted
                else:
                    target.prefill(batch, admitted)
                drafter.admit(admitted)
                policy.admit(admitted)
                engine.sync()
                prefill = now() - t0
                prefill_tokens = int((batch.prompt_lens[admitted] - 1).sum())
            slots = batch.active()
            if folded.numel():
                slots = slots[~torch.isin(slots, folded)]
            if not slots.numel():
                break
            lens = batch.lens[slots].clone()
            t0 = now()
            dev_slots = boundary.to_device(slots, batch.tokens.device)
            speculate = policy.num_drafts > 0 and policy.speculate(dev_slots, batch.generations[dev_slots])
            if speculate and policy.drafting is not None:
                speculate = bool(check_drafting(policy, slots.numel()).any())  # no request drafts: a plain step
            decided = now() - t0
            if speculate:
                out, commit = speculative_step(engine, batch, slots, policy, stop_ids, decided, launched)
            else:
                out, commit = plain_step(engine, batch, slots, stop_ids, decided, launched)
            out.owners = batch.owners[slots].clone()
            # none past the count or a stop
            out.useful_per_request = torch.minimum(lens + commit, batch.ends[slots]) - lens
            out.useful = int(out.useful_per_request.sum())
            out.times.prefill, prefill = prefill, 0.0
            out.prefill_tokens, prefill_tokens = prefill_tokens, 0
            if folded.numel():
                out.prefill_folded, out.folded_owners = True, batch.owners[folded].clone()
            out.kv_tokens, out.kv_longest = int((lens - 1).sum()), int((lens - 1).max())
            out.host_syncs += 1  # the policy's read of the commit lengths, now or after the next launch
            if defer:
                held.append((commit, out))
            else:
                t0 = now()
                policy.observe(commit, out)  # feedback from the step's outcome, charged to plan
                out.times.plan += now() - t0
                _observe_seconds(policy, out)
            result.steps.append(out)
            yield out
    finally:
        launched()  # the last step's outcome: the policy has seen every step when the run ends
        drafter.finish()
        target.finish()
    result.max_batch = batch.num_slots
    result.num_tokens, result.finish_reasons = scheduler.result.num_tokens, scheduler.result.finish_reasons
    result.startup_seconds = result.steps[0].times.prefill
    result.steps[0].times.prefill = 0.0
    result.seconds = result.startup_seconds + sum(s.times.total for s in result.steps)
    return result
