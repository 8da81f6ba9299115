"""A live run beside its replay: do they take the same steps, and what does the cost model charge for the live ones.

`step_agreement` compares a live `GenerateResult` with the replay of the same queue step by step (speculate or
not, the requests in the slots, verify lengths, commit lengths) and the live tokens with the trace's greedy
continuation; what differs is shown with the logit gap that decided it. `priced_steady` prices the live run's
steady steps with the serving cost model the replay charges (`dspark.replay.sim.step_price`): when the steps
agree, the replay's tok/s is exactly the live tokens over those priced seconds, so a gap between live and
replayed tok/s is the cost model's error on those very steps plus the prefill the replay does not charge.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.cost.serving import ServingCost
from dspark.engine.results import GenerateResult, StepOutcome
from dspark.replay.sim import step_price
from dspark.replay.trace import Trace

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


def priced_steady(res: GenerateResult, cost: ServingCost) -> dict:
    """A live run's steady window (every slot busy) measured and priced by `cost`.

    Returns tokens, measured seconds without and with prefill, the priced seconds (`step_price` of each step),
    the cost model's relative error on them (priced / measured - 1, all steps and speculative / plain apart),
    and tok/s three ways: measured with prefill (what the demo reports), without, and priced."""
    busy = [s for s in res.steps if s.requests.numel() == res.max_batch]
    tokens = sum(s.useful for s in busy)
    out: dict = {"tokens": tokens, "steps": len(busy)}
    for part, steps in (("all", busy), ("speculative", [s for s in busy if s.speculated]),
                        ("plain", [s for s in busy if not s.speculated])):
        measured = sum(s.times.total - s.times.prefill for s in steps)
        priced = sum(step_price(cost, s.requests.numel(), s.layout.total_rows, s.speculated) for s in steps)
        out[part] = {"steps": len(steps), "measured_s": measured, "priced_s": priced,
                     "cost_error": priced / measured - 1.0 if measured > 0 else None}
    prefill = sum(s.times.prefill for s in busy)
    measured, priced = out["all"]["measured_s"], out["all"]["priced_s"]
    out["prefill_s"] = prefill
    out["tok_s"] = tokens / (measured + prefill) if measured + prefill > 0 else 0.0
    out["tok_s_no_prefill"] = tokens / measured if measured > 0 else 0.0
    out["priced_tok_s"] = tokens / priced if priced > 0 else 0.0
    return out
