"""Deferred feedback (`EngineConfig.defer_observe`): a step's outcome reaches the policy once the next step's forward
is launched, exactly once and in order, the last one before the run returns; decoding stays lossless; the default
defers on an accelerator only."""
from __future__ import annotations

import pytest
import torch

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
    step = -1  # the step whose hooks run now
    for i, (kind, o) in enumerate(policy.events):
        if kind == "speculate":
            step += 1
        elif kind == "observe":
            assert policy.events[i + 1][0] == "seconds"  # its seconds right after it
            held = index[id(o)]
            # deferred: during the next step (after its speculate, before its confidence: the draft is launched);
            # else within its own step (before the next speculate)
            assert held == (step - 1 if defer and held < len(out.steps) - 1 else step), (i, held, step)
            if defer and held < len(out.steps) - 1 and out.steps[held + 1].speculated:
                assert policy.events[i - 1][0] == "speculate" and policy.events[i + 2][0] == "confidence"
    assert any(not s.speculated for s in out.steps) and any(s.speculated for s in out.steps)
    assert policy.events[-1][0] == "seconds"  # the last step's feedback before the run returned


def test_deferred_feedback_is_lossless_and_the_adaptive_gate_reads_the_outcome_one_step_later(decoders) -> None:
    prompts = _prompts(4, 6, seed=3)
    ref = decoders[False].generate(prompts, 16, FixedK(0), mode="static")
    for defer, dec in decoders.items():
        policy = Adaptive(_planner(device=dec.device), lambda b: 0.004 * b, gate=GateSettings(probe_every=2))
        out = dec.generate(prompts, 16, policy, mode="compact", max_batch=3)
        assert torch.equal(out.tokens, ref.tokens), defer
        assert policy.feedback.counts.sum() > 0  # every speculative outcome reached the realised averages


def test_defer_observe_defaults_to_the_accelerator_and_refuses_a_non_bool(device) -> None:
    assert EngineConfig(device=device).defers_observe == (device.type != "cpu")
    for value in (True, False):
        assert EngineConfig(device=device, defer_observe=value).defers_observe is value
    with pytest.raises(TypeError, match="defer_observe must be a bool or None, got str: 'yes'"):
        EngineConfig(defer_observe="yes")
