"""Every variant of the policy lab replays losslessly, and the oracle-survival variant plans from the truth.

`OracleSurvival` is the adaptive policy given the step's own outcome as survival: each speculative step's
survival must be 1 on the drafts the target accepts and 0 after them, and the planner then never needs
more rows than the oracle to commit the same tokens.
"""
from __future__ import annotations

import pytest
import torch

from dspark.lab.replay.lab import queue_ids
from dspark.lab.replay.variants import VARIANTS, OracleSurvival, PerRequestOracle, variant_lab
from tests.lab.test_replay_lab import GAMMA, _lab, synthetic_trace

pytestmark = pytest.mark.cpu_only(reason="the trace replay runs on host tensors (a simulated target, no device work)")


@pytest.mark.parametrize("name", VARIANTS)
def test_every_variant_commits_the_continuation(name: str) -> None:
    trace = synthetic_trace(30, seed=11)
    ids = queue_ids(trace, 12)
    lab, policy = variant_lab(_lab(trace), name, 4, ids)
    res = lab.run(policy, 4, ids)
    for q, i in enumerate(ids.tolist()):
        n = int(trace.new_tokens[i])
        assert torch.equal(res.tokens[q, :n], trace.greedy(i, 0, n)), (name, q)


@pytest.mark.parametrize("seed", [2, 7, 19])
def test_oracle_survival_is_the_accepted_prefix(seed: int) -> None:
    trace = synthetic_trace(30, seed=seed)
    ids = queue_ids(trace, 12)
    lab, policy = variant_lab(_lab(trace), "oracle survival", 6)
    assert isinstance(policy, OracleSurvival) and lab.temperatures is None
    res = lab.run(policy, 6, ids)
    pos = {q: 0 for q in range(len(ids))}
    speculative = 0
    for step in res.steps:
        a = torch.tensor([int(trace.position(int(ids[q]), pos[q]).accepted) for q in step.owners.tolist()])
        if step.speculated:
            speculative += 1
            truth = (torch.arange(GAMMA)[None, :] < a[:, None]).to(step.plan.survival.dtype)
            assert torch.equal(step.plan.survival.round(), truth), step.plan.survival
        for j, q in enumerate(step.owners.tolist()):
            pos[q] += int(step.commit_lens[j])
    assert speculative > 0


@pytest.mark.parametrize("seed", [3, 8])
def test_the_per_request_oracle_drafts_exactly_the_requests_that_accept(seed: int) -> None:
    """Each step drafts for the requests whose first draft the target accepts, and only for them; a step where
    none would is plain."""
    trace = synthetic_trace(30, seed=seed)
    ids = queue_ids(trace, 12)
    lab, policy = variant_lab(_lab(trace), "per-request oracle", 5, ids)
    assert isinstance(policy, PerRequestOracle)
    res = lab.run(policy, 5, ids)
    pos = {q: 0 for q in range(len(ids))}
    drafted = skipped = 0
    for step in res.steps:
        a = torch.tensor([int(trace.position(int(ids[q]), pos[q]).accepted) for q in step.owners.tolist()])
        assert step.drafting == int((a >= 1).sum()), (step.drafting, a)
        assert torch.equal(step.commit_lens.to(torch.int64), a.clamp(max=GAMMA) + 1)  # every accepted draft verified
        drafted += step.drafting
        skipped += int((a == 0).sum())
        for j, q in enumerate(step.owners.tolist()):
            pos[q] += int(step.commit_lens[j])
    assert drafted > 0 and skipped > 0


def test_oracle_survival_needs_the_prepass() -> None:
    trace = synthetic_trace(10, seed=1)
    _, policy = variant_lab(_lab(trace), "oracle survival", 2)
    with pytest.raises(ValueError, match="oracle survival reads a full verify .* pass `prepass`"):
        policy.plan(torch.zeros(2, GAMMA), torch.arange(2), torch.ones(2, dtype=torch.int64))


def test_an_unknown_variant_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown variant 'lag 3'"):
        variant_lab(_lab(synthetic_trace(10, seed=1)), "lag 3", 2)


def test_the_gate_variants_switch_off_what_they_name() -> None:
    base = _lab(synthetic_trace(10, seed=1))
    names = ("head+STS", "no cost feedback", "no catch-up price", "whole-batch probes", "no probes")
    gates = {name: variant_lab(base, name, 2)[0].gate for name in names}
    assert gates["head+STS"].cost_window is not None and gates["head+STS"].catch_up_seconds > 0
    assert gates["no cost feedback"].cost_window is None
    assert gates["no cost feedback"].catch_up_seconds == gates["head+STS"].catch_up_seconds
    assert gates["no catch-up price"].catch_up_seconds == 0.0
    assert gates["no catch-up price"].cost_window == gates["head+STS"].cost_window
    assert gates["head+STS"].probe_requests == 16 and gates["whole-batch probes"].probe_requests is None
    assert gates["no probes"].probe_every > 10 ** 6 and gates["no probes"].cost_window == gates["head+STS"].cost_window


def test_the_lab_budgets_lag_zero_by_the_live_argmax_and_the_scan_variant_does_not() -> None:
    """A replay decodes greedily, so at lag 0 its planners take the argmax over live survival (as the demo's do);
    the variant "lag-0 scan" plans as a sampling run must, and a lagged planner reads its ring."""
    lab = _lab(synthetic_trace(10, seed=1))
    assert lab.lag == 0 and lab.planner(4).settings.live_argmax and lab.policy("adaptive", 4).greedy_only
    for name in ("lag-0 scan", "lag 1"):
        other, policy = variant_lab(lab, name, 4)
        assert not other.planner(4).settings.live_argmax and not other.policy(policy, 4).greedy_only, name
