"""Deferred feedback (`EngineConfig.defer_observe`): a step's outcome reaches the policy once the next step's forward
is launched, exactly once and in order, the last one before the run returns; decoding stays lossless; the default
defers on an accelerator only."""
from __future__ import annotations

import pytest
import torch

from dspark.calibration.online import OnlineAcceptanceEstimator
from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import Adaptive, FixedK
from dspark.serve.policies.gate import GateSettings
from tests.engine_models import tiny_models
from tests.serve.test_engine import _prompts
from tests.serve.test_engine_speculate import GAMMA, _planner

pytestmark = pytest.mark.usefixtures("one_thread")


class Recording(FixedK):
    """Fixed-2 that decodes plain at every third step and records its hooks in order."""

    def __init__(self) -> None:
        super().__init__(2)
        self.events: list[tuple[str, object]] = []

    def speculate(self, slots, generations) -> bool:
        self.events.append(("speculate", None))
        return sum(e[0] == "speculate" for e in self.events) % 3 != 0

    def confidence(self, drafts):
        self.events.append(("confidence", None))
        return super().confidence(drafts)

    def observe(self, commit_lens, outcome=None) -> None:
        self.events.append(("observe", outcome))

    def observe_seconds(self, seconds, prefill_tokens=0) -> None:
        self.events.append(("seconds", seconds))


@pytest.fixture(scope="module")
def decoders(device) -> dict[bool, SpecDecoder]:
    target, draft = tiny_models(gamma=GAMMA)
    base = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=4096, page_size=8, device=device,
                                                          defer_observe=False))
    return {False: base, True: base.fork(defer_observe=True)}


@pytest.mark.parametrize("defer", [False, True])
def test_each_outcome_reaches_the_policy_once_in_order_after_the_next_launch_when_deferred(decoders, defer) -> None:
    policy = Recording()
    out = decoders[defer].generate(_prompts(5, 4), 7, policy, max_batch=2)  # refills: admissions between steps
    observed = [o for kind, o in policy.events if kind == "observe"]
    assert [id(o) for o in observed] == [id(s) for s in out.steps]  # every step once, in order
    assert [kind for kind, _ in policy.events].count("seconds") == len(out.steps)
    index = {id(o): n for n, o in enumerate(observed)}
    step, seconds = -1, 0  # the step whose hooks run now; the steps whose seconds were observed
    for i, (kind, o) in enumerate(policy.events):
        if kind == "speculate":
            step += 1
            assert seconds == step  # every earlier step's seconds came at its own end, deferred or not
        elif kind == "seconds":
            seconds += 1
        elif kind == "observe":
            held = index[id(o)]
            # deferred: during the next step (after its speculate, before its confidence: the draft is launched);
            # else within its own step (before its seconds and the next speculate)
            assert held == (step - 1 if defer and held < len(out.steps) - 1 else step), (i, held, step)
            if defer and held < len(out.steps) - 1 and out.steps[held + 1].speculated:
                assert policy.events[i - 1][0] == "speculate" and policy.events[i + 1][0] == "confidence"
            if not defer:
                assert policy.events[i + 1][0] == "seconds"
    assert any(not s.speculated for s in out.steps) and any(s.speculated for s in out.steps)
    # the last step's outcome before the run returned
    assert policy.events[-1][0] == ("observe" if defer else "seconds")


def test_deferred_feedback_is_lossless_and_the_adaptive_gate_reads_the_outcome_one_step_later(decoders) -> None:
    prompts = _prompts(4, 6, seed=3)
    ref = decoders[False].generate(prompts, 16, FixedK(0), mode="static")
    for defer, dec in decoders.items():
        policy = Adaptive(_planner(device=dec.device), lambda b: 0.004 * b, gate=GateSettings(probe_every=2))
        out = dec.generate(prompts, 16, policy, mode="compact", max_batch=3)
        assert torch.equal(out.tokens, ref.tokens), defer
        assert policy.feedback.counts.sum() > 0  # every speculative outcome reached the realised averages


def test_a_deferred_outcome_labels_the_estimator_with_the_requests_that_drafted_in_its_own_step(decoders) -> None:
    """Partial probes of one request: the next step's `speculate` has set its own drafting mask when the held
    outcome is observed; the estimator still takes one position-0 label per request that drafted in that step."""
    dec = decoders[True]
    prompts = _prompts(4, 6, seed=6)
    est = OnlineAcceptanceEstimator(GAMMA, refit_every=2, min_labels=4)
    gate = GateSettings(probe_every=2, max_probe_every=2, cost_window=None, probe_requests=1, probe_budget=None)
    policy = Adaptive(_planner(lag=0, device=dec.device), plain_seconds=lambda b: 1e-6, gate=gate, estimator=est)
    out = dec.generate(prompts, 16, policy, mode="static")
    assert torch.equal(out.tokens, decoders[False].generate(prompts, 16, FixedK(0), mode="static").tokens)
    spec = [s for s in out.steps if s.speculated]
    assert any(s.drafting < s.requests.numel() for s in spec)
    assert est.labels_seen[0] == sum(s.drafting for s in spec)


def test_defer_observe_defaults_to_the_accelerator_and_refuses_a_non_bool(device) -> None:
    assert EngineConfig(device=device).defers_observe == (device.type != "cpu")
    for value in (True, False):
        assert EngineConfig(device=device, defer_observe=value).defers_observe is value
    with pytest.raises(TypeError, match="defer_observe must be a bool or None, got str: 'yes'"):
        EngineConfig(defer_observe="yes")
