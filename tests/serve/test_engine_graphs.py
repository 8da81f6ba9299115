"""The engine's verify forward through `TierGraphRunner`: a decoder with tiers replays each compact step's tier
(eager backend on the CPU) and commits the same tokens as a decoder without tiers."""
from __future__ import annotations

import logging

import pytest
import torch

from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import FixedK, Oracle
from tests.engine_models import VOCAB, tiny_models

pytestmark = pytest.mark.usefixtures("one_thread")

TIERS = (4, 8, 12)


def _prompts(b: int, p: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, p), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("policy", [FixedK(3), Oracle(3)], ids=lambda p: p.name)
def test_compact_steps_replay_their_tier_and_commit_the_same_tokens(policy, device, caplog) -> None:
    target, draft = tiny_models()
    plain = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=2048, page_size=8, device=device))
    tiered = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=2048, page_size=8, device=device, tiers=TIERS))
    prompts = _prompts(4, 6)
    want = plain.generate(prompts, 10, policy, mode="compact", max_batch=3)
    caplog.set_level(logging.INFO, logger="dspark.verify.graphs")
    got = tiered.generate(prompts, 10, policy, mode="compact", max_batch=3)  # continuous batching: 3 slots, 4 prompts
    assert torch.equal(got.tokens, want.tokens)
    # the draft reads the target's hidden states: the graph step stores the same ones, so drafts agree too
    assert [s.commit_lens.tolist() for s in got.steps] == [s.commit_lens.tolist() for s in want.steps]
    runner = tiered._verify_steps.get(3, 4).runner
    tiers_seen = [s.layout.tier for s in got.steps]
    for tier in TIERS:  # every step that replayed a tier is counted by the runner (the oracle also replays its prepass)
        assert runner.replays[tier] >= tiers_seen.count(tier)
    assert sum(runner.replays.values()) >= sum(t is not None for t in tiers_seen) > 0
    past = sum(s.layout.total_rows > TIERS[-1] for s in got.steps)  # 3 requests x 4 rows = 12 rows: never past
    # a step a refill's prompt rides runs eager, unpadded (chunked prefill); every other step replays its tier
    assert past == 0 and all(s.layout.graph_num_tokens == s.layout.tier for s in got.steps if not s.prefill_folded)
    assert any(s.prefill_folded for s in got.steps) and all(s.layout.tier is None for s in got.steps if s.prefill_folded)
    if isinstance(policy, Oracle):  # ragged verify lengths: padding rows in ghost slots
        assert any(s.layout.num_padding_rows > 0 for s in got.steps)


def test_steps_past_the_largest_tier_run_eager_through_the_same_step(device, caplog) -> None:
    target, draft = tiny_models()
    tiered = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=2048, page_size=8, device=device, tiers=(4,)))
    plain = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=2048, page_size=8, device=device))
    prompts = _prompts(3, 6)
    caplog.set_level(logging.INFO, logger="dspark.verify.graphs")
    got = tiered.generate(prompts, 8, FixedK(3), mode="static")  # 3 x 4 = 12 rows > tier 4
    assert torch.equal(got.tokens, plain.generate(prompts, 8, FixedK(3), mode="static").tokens)
    runner = tiered._verify_steps.get(3, 4).runner
    past = [s for s in got.steps if s.requests.numel() * 4 > 4]  # static: B x W rows; B = 1 fits tier 4
    assert past and runner.eager_steps == len(past) and sum(runner.replays.values()) == len(got.steps) - len(past)
    assert all(s.layout.tier is None for s in past) and "largest captured tier 4" in caplog.text


def test_captures_are_reused_across_runs_and_forks_capture_their_own(device) -> None:
    target, draft = tiny_models()
    dec = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=2048, page_size=8, device=device, tiers=TIERS))
    dec.generate(_prompts(2, 6), 4, FixedK(2))
    step = dec._verify_steps.get(2, 3)
    dec.generate(_prompts(2, 6), 4, FixedK(2))
    assert dec._verify_steps.get(2, 3) is step
    twin = dec.fork()
    assert twin._verify_steps.cache is twin.tcache and twin._verify_steps is not dec._verify_steps
    assert dec._verify_steps.get(2, 1) is None  # target-only runs have no verify step


def test_a_fork_serving_fewer_tiers_pads_past_the_left_out_ones(device) -> None:
    target, draft = tiny_models()
    dec = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=2048, page_size=8, device=device, tiers=TIERS))
    served = dec.fork(tiers=(4, 12))  # tier 8 left out (`serving_tiers`): 5-8 row steps replay tier 12
    prompts = _prompts(2, 6)
    want = dec.generate(prompts, 8, FixedK(3), mode="compact")  # 2 x 4 = 8 rows: tier 8
    got = served.generate(prompts, 8, FixedK(3), mode="compact")
    assert torch.equal(got.tokens, want.tokens)
    tiers = [s.layout.tier for s in want.steps]
    assert 8 in tiers and [s.layout.tier for s in got.steps] == [12 if t == 8 else t for t in tiers]
    assert all(s.layout.num_padding_rows == (4 if s.layout.tier == 12 else 0) for s in got.steps)
    assert served.tiers == (4, 12) and dec.tiers == TIERS
    for bad in ((4, 16), (), (12, 4)):
        with pytest.raises(ValueError, match="tiers"):
            dec.fork(tiers=bad)


def test_every_verify_width_a_policy_may_take_is_captured_before_its_first_step(device, monkeypatch) -> None:
    """An adaptive policy choosing its depth verifies at W = 2, 3 and 4: all three steps are built (captured)
    when the run starts, none inside a timed step; a fixed policy builds its own width only."""
    from dspark.config import ScheduleConfig
    from dspark.cost import StepsPerSecondTable
    from dspark.plan.planner import PlannerSettings, VerifyPlanner
    from dspark.serve.policies import Adaptive
    from dspark.serve.tier_step import VerifySteps

    target, draft = tiny_models()
    dec = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=2048, page_size=8, device=device, tiers=TIERS))

    def planner(k: int) -> VerifyPlanner:
        cost = StepsPerSecondTable([1], [100.0], width=k + 1)
        settings = PlannerSettings(lag=0, num_slots=3, tiers=TIERS, graph_slots=dec.graph_slots(3, k + 1))
        return VerifyPlanner(ScheduleConfig(gamma=k), cost, settings, device=device)

    built, stepped = [], [0]
    get = VerifySteps.get
    monkeypatch.setattr(VerifySteps, "get", lambda self, b, w: built.append((stepped[0], w)) or get(self, b, w))
    for policy, widths in ((Adaptive(planner(3), lambda b: 1.0, depths={1: planner(1), 2: planner(2)}), [2, 3, 4]),
                           (FixedK(2), [3])):
        built.clear()
        stepped[0] = 0
        for _ in dec.start(_prompts(3, 6), 8, policy, mode="compact"):
            stepped[0] += 1
        assert sorted({w for n, w in built if n == 0}) == widths
        assert {w for n, w in built} == set(widths)  # nothing else is built later
