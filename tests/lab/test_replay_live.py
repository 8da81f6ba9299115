"""Replay reproduces live runs: the live engine and the trace replay, given the same policy factory, take
the same decisions step by step (verify lengths, commit lengths, speculate or not) on the tiny models; and
`dspark.lab.replay.live` shows what differs and prices the live steps with the replay's cost model."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from engine_models import VOCAB, tiny_models

from dspark.config import VerifyMode
from dspark.cost.serving import load_serving_cost
from dspark.cost.shipped import h100_llama8b_fitted
from dspark.lab.replay.lab import UNTIMED_PROBE, Lab
from dspark.lab.replay.live import live_tiers, priced_phases, step_agreement, work_of
from dspark.lab.replay.record import RecordSettings, record_trace
from dspark.lab.replay.workload import Request
from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.verify.layout import tier_ladder

pytestmark = pytest.mark.cpu_only(reason="the replay runs on host tensors; the live side is compared on the CPU")
GAMMA, N = 4, 10


@functools.lru_cache(maxsize=None)
def _setup():
    target, draft = tiny_models(gamma=GAMMA)
    g = torch.Generator().manual_seed(7)
    requests = [Request("code" if i % 2 else "chat", torch.randint(3, VOCAB, (int(p),), generator=g), int(n))
                for i, (p, n) in enumerate(zip(torch.randint(4, 9, (N,), generator=g), torch.randint(3, 12, (N,), generator=g)))]
    trace = record_trace(target, draft, requests, draft_sha256="0" * 64,
                         settings=RecordSettings(gamma=GAMMA, max_batch=4))
    decoder = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=4096))
    cost = h100_llama8b_fitted(gamma=GAMMA, max_requests=8)
    cost = dataclasses.replace(cost, drafter=dataclasses.replace(cost.drafter, per_catch_up_token=20e-6))
    # the lab folds a refill's prompt into the next step as the live engine does (the H100 fit alone would not)
    return trace, decoder, Lab(trace, cost, GAMMA, temperatures=[1.0, 1.2, 0.9, 1.1], tiers=False, probe=UNTIMED_PROBE,
                               fold_prefill=decoder.config.fold_prefill)


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("policy", ["fixed-0", "fixed-2", f"fixed-{GAMMA}", "adaptive", "adaptive-est", "oracle"])
def test_replay_takes_the_live_engines_decisions_step_by_step(policy: str, b: int) -> None:
    trace, decoder, lab = _setup()
    ids = torch.arange(N)
    live_lab, replay_lab = (dataclasses.replace(lab, estimators={}) for _ in range(2))  # one estimator each
    live = decoder.generate([trace.prompt(i) for i in range(N)], trace.new_tokens.clone(), live_lab.policy(policy, b),
                            mode=VerifyMode.COMPACT, max_batch=b)
    sim = replay_lab.run(policy, b, ids)
    assert torch.equal(live.tokens, sim.tokens)
    assert len(live.steps) == len(sim.steps)
    for i, (x, y) in enumerate(zip(live.steps, sim.steps)):
        assert x.speculated == y.speculated, i
        assert torch.equal(x.owners, y.owners), i
        assert torch.equal(x.caps.cpu().to(torch.int64), y.caps.to(torch.int64)), (i, x.caps, y.caps)
        assert torch.equal(x.commit_lens.cpu(), y.commit_lens), i
        if x.speculated:
            torch.testing.assert_close(x.confidence_logits.cpu(), y.confidence_logits, rtol=1e-4, atol=1e-4)


def test_agreement_and_prices_of_a_live_run_beside_its_replay() -> None:
    trace, decoder, lab = _setup()
    ids = torch.arange(N)
    live_lab, replay_lab = (dataclasses.replace(lab, estimators={}) for _ in range(2))
    live = decoder.generate([trace.prompt(i) for i in range(N)], trace.new_tokens.clone(),
                            live_lab.policy("adaptive", 4), mode=VerifyMode.COMPACT, max_batch=4)
    sim = replay_lab.run("adaptive", 4, ids)
    agree = step_agreement(live, sim, trace, ids)
    assert agree["identical"] == agree["compared"] == len(sim.steps) and agree["differing_steps"] == 0
    assert agree["diverging_requests"] == 0
    priced = priced_phases(live, lab.cost)
    # the steps agree, so the replay's seconds are the cost model's price of the live steps, phase by phase
    assert priced["all"]["priced_s"] == pytest.approx(sim.seconds, rel=1e-12)
    for x, y in zip(live.steps, sim.steps):
        assert work_of(x) == work_of(y)  # the same rows, depth, KV tokens, prefill tokens and draft catch-up
        w = work_of(y)
        assert y.times.draft == pytest.approx(lab.cost.drafter.seconds(w.drafts, w.drafting, w.catch_up))
    spec = [s for s in live.steps if s.speculated]
    assert spec[0].catch_up > 0 and any(s.catch_up for s in spec[1:])  # the prompts, then commits beyond the roots
    measured = live.startup_seconds + sum(s.times.total for s in live.steps)
    assert priced["all"]["measured_s"] == pytest.approx(measured)
    assert priced["all"]["error"] == pytest.approx(priced["all"]["priced_s"] / measured - 1)
    assert priced["plan"]["priced_s"] == 0.0 and priced["draft"]["priced_s"] > 0


def test_agreement_shows_the_steps_and_tokens_that_differ() -> None:
    trace, decoder, lab = _setup()
    ids = torch.arange(N)
    live = decoder.generate([trace.prompt(i) for i in range(N)], trace.new_tokens.clone(), lab.policy("fixed-2", 1),
                            mode=VerifyMode.COMPACT, max_batch=1)
    agree = step_agreement(live, lab.run(f"fixed-{GAMMA}", 1, ids), trace, ids)
    assert 0 < agree["differing_steps"] and agree["identical"] < agree["compared"]
    first = agree["first_differing"][0]
    assert first["live"]["caps"] == [3] and first["replay"]["caps"] == [GAMMA + 1]
    tampered = dataclasses.replace(trace)  # the same trace with request 3's fifth token changed
    tampered.continuation = trace.continuation.clone()
    start = int(trace.position_offsets[3]) + 3 * trace.gamma
    tampered.continuation[start + 4] = (tampered.continuation[start + 4] + 1) % VOCAB
    same = lab.run("fixed-2", 1, ids)
    out = step_agreement(live, same, tampered, ids)
    assert out["identical"] == out["compared"]
    assert out["diverging_requests"] == 1 and out["divergences"][0]["request"] == 3
    assert out["divergences"][0]["position"] == 4
    assert out["divergences"][0]["target_top2_gap"] == pytest.approx(float(trace.margins(3)[4]))


def test_a_cost_table_from_another_geometry_is_refused_with_its_values() -> None:
    cpu = load_serving_cost("cpu-measured", width=4)
    ladder = tier_ladder((1, 4, 16), 4)
    reach = live_tiers(cpu, cpu.platform, ladder, [1, 4, 16], 4)
    assert reach == (1, 2, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)  # the shipped table's tiers up to 16 x 4; not 96
    with pytest.raises(ValueError, match="models platform 'h100-cuda' but the live run decodes on 'x86_64-cpu'"):
        live_tiers(load_serving_cost("h100-llama8b-fitted", width=4), "x86_64-cpu", ladder, [1, 4, 16], 4)
    with pytest.raises(ValueError, match="covers B <= 256 but the live run serves B = 512"):
        live_tiers(cpu, cpu.platform, tier_ladder((512,), 4), [1, 512], 4)
    with pytest.raises(ValueError, match=r"prices eager steps \(no graph tiers\)"):
        live_tiers(dataclasses.replace(cpu, tiers=()), cpu.platform, ladder, [1, 4, 16], 4)
    with pytest.raises(ValueError, match=r"prices graph tiers \[1, 2, 4, 5, 6, 8, 12, 16\] .* \(missing \[5, 6\]\)"):
        live_tiers(cpu, cpu.platform, (1, 2, 4, 8, 12, 16), [1, 4], 4)
    h100 = load_serving_cost("h100-llama8b-fitted", width=4)  # additive: its tiers are the engine's alone
    with pytest.raises(ValueError, match=r"prices no graph tier up to max B x W = 4 \(its smallest: 8\)"):
        live_tiers(dataclasses.replace(h100, tiers=(8, 16)), h100.platform, (1, 2, 4, 8, 16), [1], 4)
    with pytest.raises(ValueError, match=r"prices verify width W = 4 but the live run verifies W = 7 \(gamma = 6\)"):
        live_tiers(cpu, cpu.platform, ladder, [1, 4, 16], 7)
    with pytest.raises(ValueError, match=r"batch_sizes must name at least one live batch size, got \[\]"):
        live_tiers(cpu, cpu.platform, ladder, [], 4)
    with pytest.raises(ValueError, match=r"tiers \[3, 8\] differ from the tiered verify model's \[1, 2, 4"):
        dataclasses.replace(cpu, tiers=(3, 8))  # a tiered table prices its own tiers
