"""Deferred feedback (`EngineConfig.defer_observe`): a step's outcome reaches the policy once the next step's forward
is launched, exactly once and in order, the last one before the run returns; decoding stays lossless; the default
defers on an accelerator only."""
from __future__ import annotations

import pytest
import torch

from dspark.calibration.online import OnlineAcceptanceEstimator
from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import Adaptive, FixedK, Oracle
from dspark.serve.policies.adaptive import FeedbackSettings
from dspark.serve.policies.gate import GateSettings
from tests.engine_models import tiny_models
from tests.serve.test_engine import _prompts
from tests.serve.test_engine_speculate import GAMMA, STEP, _planner

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
            assert seconds == (max(step - 1, 0) if defer else step)  # deferred: all but the previous step's
        elif kind == "seconds":
            seconds += 1
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


def test_deferred_feedback_is_lossless_and_the_adaptive_policy_sees_each_outcome_one_step_later(decoders) -> None:
    prompts = _prompts(4, 6, seed=3)
    ref = decoders[False].generate(prompts, 16, FixedK(0), mode="static")
    for defer, dec in decoders.items():
        policy = Adaptive(_planner(lag=0, device=dec.device), lambda b: 1e-6 * b, gate=GateSettings(probe_every=2))
        run = dec.start(prompts, 16, policy, mode="compact", max_batch=3)
        seen = []  # request outcomes in the realised averages when each step is handed out
        try:
            while True:
                step = next(run)
                seen.append((int(policy.feedback.counts[0]), step.requests.numel() if step.speculated else 0))
        except StopIteration as stop:
            out = stop.value
        assert torch.equal(out.tokens, ref.tokens), defer
        assert seen[0][1] > 0 and len(seen) > 3  # lag 0: the first step speculates
        # in order, a step's outcome is counted when it is handed out; deferred, one step later
        counted = [n for n, _ in seen]
        drafted = [sum(d for _, d in seen[: i + 1 - defer]) for i in range(len(seen))]
        assert counted == drafted, defer
        assert policy.feedback.counts[0] == sum(d for _, d in seen)  # the last one too, before the run returned


def test_a_run_closed_early_still_hands_its_last_outcome_to_the_policy(decoders) -> None:
    policy = Recording()
    run = decoders[True].start(_prompts(3, 4), 12, policy)
    steps = [next(run), next(run)]
    assert [id(o) for kind, o in policy.events if kind == "observe"] == [id(steps[0])]  # the second is held
    run.close()
    assert [id(o) for kind, o in policy.events if kind == "observe"] == [id(s) for s in steps]


def test_a_policy_observes_in_order_unless_it_says_its_observe_may_wait(decoders) -> None:
    """`Policy.observe_deferrable` is False by default: a policy of one's own, the oracle and adaptive-est (its
    estimator labels read the device) see each outcome before the next step's `speculate`."""

    class Mine(Recording):
        observe_deferrable = False

    policy = Mine()
    out = decoders[True].generate(_prompts(5, 4), 7, policy, max_batch=2)
    kinds = [kind for kind, _ in policy.events]
    assert kinds.count("observe") == len(out.steps)
    assert all(kinds[i + 1] == "seconds" for i, kind in enumerate(kinds) if kind == "observe")
    est = Adaptive(_planner(lag=0), plain_seconds=lambda b: 1e-6, estimator=OnlineAcceptanceEstimator(GAMMA))
    assert Recording.observe_deferrable and not est.observe_deferrable and not Oracle(GAMMA).observe_deferrable
    assert Adaptive(_planner(lag=0), plain_seconds=lambda b: 1e-6).observe_deferrable


def test_adaptive_est_under_deferral_labels_its_estimator_with_each_steps_own_drafters(decoders) -> None:
    """Partial probes of one request with the engine deferring: adaptive-est observes in order and its estimator
    takes one position-0 label per request that drafted in each step."""
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


def test_the_gate_keeps_each_steps_record_until_its_own_times_arrive(device) -> None:
    """Deferred feedback: step 2 begins (and goes plain) before step 1's seconds arrive. Each step's seconds are
    read against its own kind and prediction: the speculative step's 3x goes to the speculative ratio, the plain
    step's 2x to the plain one (cost_window 1: each ratio is its last sample)."""
    planner = _planner(device=device)  # lag 1: the decision reads the ring
    slots, gens = torch.tensor([0, 1], device=device), torch.tensor([1, 1], device=device)
    policy = Adaptive(planner, plain_seconds=lambda b: b / 400.0, gate=GateSettings(cost_window=1, probe_budget=None),
                      feedback=FeedbackSettings(decay=None))
    assert policy.speculate(slots, gens)  # step 1: the stale ring reads all-ones, 800 tok/s against plain's 400
    policy.plan(torch.full((2, GAMMA), 3.0, device=device), slots, gens)  # predicted STEP
    planner.ring.write(slots, gens, torch.zeros(2, GAMMA, device=device))  # tau 2 per STEP: 200 tok/s
    assert not policy.speculate(slots, gens)  # step 2: plain, predicted 2 / 400 s
    policy.observe_seconds(3 * STEP)  # step 1's seconds, after step 2 began
    policy.observe_seconds(2 * 2 / 400.0)  # step 2's
    assert policy.gate.cost_ratio == {True: pytest.approx(3.0), False: pytest.approx(2.0)}
    assert not policy.gate._steps  # every record read


def test_a_gate_whose_steps_are_never_timed_keeps_two_records_at_most(device) -> None:
    """A loop of one's own that calls `speculate` / `plan` and never `observe_seconds` does not grow the gate."""
    slots, gens = torch.tensor([0, 1], device=device), torch.tensor([1, 1], device=device)
    policy = Adaptive(_planner(lag=0, device=device), plain_seconds=lambda b: b / 400.0)
    for _ in range(50):
        if policy.speculate(slots, gens):
            policy.plan(torch.full((2, GAMMA), 3.0, device=device), slots, gens)
    assert len(policy.gate._steps) == 2
