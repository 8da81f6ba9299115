"""A live run beside its replay: do they take the same steps, and what does the cost model charge for the live ones.

`step_agreement` compares a live `GenerateResult` with the replay of the same queue step by step (speculate or
not, the requests in the slots, verify lengths, commit lengths) and the live tokens with the trace's greedy
continuation; what differs is shown with the logit gap that decided it. `priced_phases` prices every live step
with the rules the replay charges (`ServingCost.price` of the step's `StepWork`) phase by phase: when the steps
agree, the replay's seconds are exactly these priced seconds, so the gap between live and replayed tok/s is the
sum of the per-phase residuals it reports (draft, target, prefill, and the plan and host time the replay does
not charge). `live_tiers` checks that a cost table was profiled for the live run's geometry before any work.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import Tensor

from dspark.cost.serving import ServingCost, StepWork
from dspark.lab.replay.trace import Trace
from dspark.serve.outcome import GenerateResult, StepOutcome
from dspark.util.validate import check_int, check_type

SHOWN = 8  # differing steps and diverging requests listed in full


def _same_step(x: StepOutcome, y: StepOutcome) -> bool:
    return (x.speculated == y.speculated and torch.equal(x.owners.cpu(), y.owners.cpu())
            and torch.equal(x.caps.cpu().to(torch.int64), y.caps.cpu().to(torch.int64))
            and torch.equal(x.commit_lens.cpu().to(torch.int64), y.commit_lens.cpu().to(torch.int64)))


def _difference(i: int, x: StepOutcome, y: StepOutcome) -> dict:
    conf_gap = None
    if x.speculated and y.speculated and x.confidence_logits.shape == y.confidence_logits.shape:
        conf_gap = float((x.confidence_logits.cpu() - y.confidence_logits.cpu()).abs().max())
    return {"step": i, "live": {"speculated": x.speculated, "caps": x.caps.cpu().tolist(),
                                "commit_lens": x.commit_lens.cpu().tolist()},
            "replay": {"speculated": y.speculated, "caps": y.caps.cpu().tolist(),
                       "commit_lens": y.commit_lens.cpu().tolist()},
            "confidence_logit_max_abs_diff": conf_gap}


def step_agreement(live: GenerateResult, replay: GenerateResult, trace: Trace, ids: Tensor) -> dict:
    """Step-by-step agreement of a live run and its replay over the trace requests `ids` [N] (the queue both
    served, in order).

    Returns steps (live, replay), identical (steps equal in every decision up to the shorter run), the first
    SHOWN differing steps (both sides' caps and commit lengths, the largest confidence-logit difference between
    the live drafter and the trace), and the requests whose live tokens leave the trace's greedy continuation:
    (request, position, the target's top-1 minus top-2 logit there, from the trace)."""
    rows = max(live.tokens.shape[0], replay.tokens.shape[0])
    if ids.ndim != 1 or ids.numel() != rows or bool(((ids < 0) | (ids >= trace.num_requests)).any()):
        raise ValueError(f"ids must be the [{rows}] trace requests both runs served (each in "
                         f"0..{trace.num_requests - 1}), got shape {list(ids.shape)}: {ids.tolist()[:SHOWN]}")
    n = min(len(live.steps), len(replay.steps))
    same = [_same_step(x, y) for x, y in zip(live.steps[:n], replay.steps[:n])]
    differing = [_difference(i, live.steps[i], replay.steps[i]) for i in range(n) if not same[i]][:SHOWN]
    diverging = []
    for row, request in enumerate(ids.tolist()):
        want = trace.greedy(request, 0, int(trace.new_tokens[request]))
        got = live.tokens[row, : want.numel()].cpu()
        bad = (got != want).nonzero()
        if bad.numel():
            pos = int(bad[0])
            diverging.append({"request": request, "position": pos, "target_top2_gap": float(trace.margins(request)[pos])})
    return {"steps": [len(live.steps), len(replay.steps)], "compared": n, "identical": sum(same),
            "differing_steps": n - sum(same) + abs(len(live.steps) - len(replay.steps)), "first_differing": differing,
            "diverging_requests": len(diverging), "divergences": diverging[:SHOWN]}


def live_tiers(cost: ServingCost, platform: str, ladder: Sequence[int], batch_sizes: Sequence[int],
               width: int) -> tuple[int, ...]:
    """The graph tiers a live run serves so that `cost` prices its steps: the cost's tiers up to max(batch_sizes) x
    width, every one of them in the live tier `ladder`. ValueError naming the value when the cost models another
    platform than the live run's (`platform`, e.g. "x86_64-cpu"), covers fewer requests than the largest B, prices
    eager steps (no tiers), or prices a tier in that reach that the ladder does not capture."""
    fix = "compare with a table profiled for this run (perf/replay_live.py --cost same-run)"
    check_type("cost", cost, ServingCost)
    batch_sizes = list(batch_sizes)
    if not batch_sizes:
        raise ValueError("batch_sizes must name at least one live batch size, got []")
    for i, b in enumerate(batch_sizes):
        check_int(f"batch_sizes[{i}]", b, 1)
    if check_int("width", width, 2) != cost.width:
        raise ValueError(f"the cost {cost.name!r} prices verify width W = {cost.width} but the live run verifies W = "
                         f"{width} (gamma = {width - 1}): {fix}")
    if cost.platform != platform:
        raise ValueError(f"the cost {cost.name!r} models platform {cost.platform!r} but the live run decodes on "
                         f"{platform!r}: {fix}")
    top = max(batch_sizes)
    if cost.max_requests < top:
        raise ValueError(f"the cost {cost.name!r} covers B <= {cost.max_requests} but the live run serves B = {top}: "
                         f"{fix}")
    if not cost.tiers:
        raise ValueError(f"the cost {cost.name!r} prices eager steps (no graph tiers) but the live run pads to its "
                         f"tier ladder {list(ladder)}: {fix}")
    reach = tuple(t for t in cost.tiers if t <= top * width)
    if not reach:
        raise ValueError(f"the cost {cost.name!r} prices no graph tier up to max B x W = {top * width} (its smallest: "
                         f"{min(cost.tiers)}): {fix}")
    missing = [t for t in reach if t not in ladder]
    if missing:
        raise ValueError(f"the cost {cost.name!r} prices graph tiers {list(reach)} but the live run captures "
                         f"{list(ladder)} (missing {missing}): {fix}")
    return reach


def work_of(step: StepOutcome) -> StepWork:
    """The StepWork of a live step (what the replay would price for it)."""
    n, k = step.requests.numel(), step.confidence_logits.shape[-1]
    return StepWork(requests=n, rows=int(step.layout.total_rows) if k else n, kv_tokens=step.kv_tokens, drafts=k,
                    drafting=step.drafting, prefill_tokens=step.prefill_tokens, catch_up=step.catch_up,
                    kv_longest=step.kv_longest, prefill_folded=step.prefill_folded)


def priced_phases(res: GenerateResult, cost: ServingCost) -> dict:
    """A live run's seconds measured and priced by `cost`, phase by phase, over every step and its prefill.

    Returns per phase (draft, target: verify + accept, prefill, plan: the policy's decision and host work)
    measured and priced seconds and priced / measured - 1, and the same for the whole run."""
    check_type("cost", cost, ServingCost)
    parts = {p: [0.0, 0.0] for p in ("draft", "target", "prefill", "plan")}
    for i, s in enumerate(res.steps):
        work = work_of(s)
        prefill = res.startup_seconds if i == 0 else s.times.prefill
        parts["draft"][0] += s.times.draft
        parts["draft"][1] += cost.drafter.seconds(work.drafts, work.drafting, work.catch_up)
        parts["target"][0] += s.times.verify + s.times.accept
        folded = work.prefill_tokens if work.prefill_folded else 0  # measured inside the target's forward
        parts["target"][1] += cost.price(dataclasses.replace(work, drafting=0, prefill_tokens=folded, catch_up=0))
        parts["prefill"][0] += prefill
        parts["prefill"][1] += cost.prefill.seconds(work.prefill_tokens - folded)
        parts["plan"][0] += s.times.plan
    out = {p: {"measured_s": m, "priced_s": q, "error": q / m - 1.0 if m > 0 else None} for p, (m, q) in parts.items()}
    measured, priced = sum(m for m, _ in parts.values()), sum(q for _, q in parts.values())
    out["all"] = {"measured_s": measured, "priced_s": priced, "error": priced / measured - 1.0 if measured else None}
    return out
