"""The adaptive policy's speculate-or-not decision: follows the costs, probes every N plain steps, lossless."""
from __future__ import annotations

import pytest
import torch

from dspark.calibration.online import OnlineAcceptanceEstimator
from dspark.config import ScheduleConfig, VerifyMode
from dspark.cost import BatchTerm, StepsPerSecondTable, TieredCostModel, TierTerm
from dspark.lab.profile import PlainStepCost
from dspark.plan.planner import PlannerSettings, VerifyPlanner
from dspark.serve.config import EngineConfig, SamplingParams
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import Adaptive, FixedK
from dspark.serve.policies.adaptive import FeedbackSettings
from dspark.serve.policies.gate import GateSettings
from tests.engine_models import tiny_models
from tests.serve.test_engine import _prompts

pytestmark = pytest.mark.usefixtures("one_thread")

GAMMA = 3
STEP = 0.01  # the speculative step costs 10 ms whatever the rows


def _planner(lag: int = 1, device: torch.device | str = "cpu") -> VerifyPlanner:
    cost = StepsPerSecondTable([1], [1 / STEP], width=GAMMA + 1)
    return VerifyPlanner(ScheduleConfig(gamma=GAMMA), cost, PlannerSettings(lag=lag, num_slots=8), device=device)


@pytest.fixture(scope="module")
def decoder(device) -> SpecDecoder:
    target, draft = tiny_models(gamma=GAMMA)
    return SpecDecoder(target, draft, config=EngineConfig(cache_tokens=4096, page_size=8, device=device))


def _speculated(out) -> list[bool]:
    return [s.confidence_logits.shape[1] > 0 for s in out.steps]


def test_decision_compares_lagged_theta_with_plain_throughput(device) -> None:
    planner = _planner(device=device)
    slots, gens = torch.tensor([0, 1], device=device), torch.tensor([1, 1], device=device)

    def decide() -> bool:  # a fresh policy each time: one policy caches its decision until it plans
        return Adaptive(planner, plain_seconds=lambda b: b / 400.0).speculate(slots, gens)  # plain: 400 tok/s

    assert decide()  # stale ring (no survival yet) reads all-ones: tau = 2 * 4 = 8 per 10 ms beats 400 tok/s
    planner.ring.write(slots, gens, torch.full((2, GAMMA), 0.9, device=device))   # tau ~ 7.4: 740 tokens/s
    assert decide()
    planner.ring.write(slots, gens, torch.zeros(2, GAMMA, device=device))         # tau = 2: 200 tokens/s
    assert not decide()


def test_realised_acceptance_decides_once_observed(device) -> None:
    """Before any outcome the lagged survival predicts; afterwards the moving averages of accepted / verified
    drafts per request do: confident survival, but nothing accepted -> plain; accepted again -> speculate.
    The decay counts request outcomes: 0.5 ** 0.5 per outcome is 0.5 per step of these 2 requests."""
    slots, gens = torch.tensor([0, 1], device=device), torch.tensor([1, 1], device=device)
    policy = Adaptive(_planner(device=device), plain_seconds=lambda b: b / 400.0, feedback=FeedbackSettings(decay=0.5 ** 0.5, prior_weight=0))
    confident = torch.full((2, GAMMA), 8.0, device=device)  # survival ~1 at every position
    assert policy.speculate(slots, gens) and policy.realised is None
    plan = policy.plan(confident, slots, gens)
    assert torch.equal(plan.verify_lens, torch.full((2,), GAMMA + 1, dtype=torch.int32, device=device))
    policy.observe(torch.tensor([GAMMA + 1, GAMMA + 1], device=device))  # every draft accepted
    assert policy.realised == pytest.approx((GAMMA, GAMMA))
    assert policy.speculate(slots, gens)  # tau = 2 * 4 per 10 ms
    policy.plan(confident, slots, gens)
    policy.observe(torch.tensor([1, 1], device=device))  # nothing accepted: (3 + 0) / 2
    assert policy.realised == pytest.approx((1.5, GAMMA))
    assert policy.speculate(slots, gens)  # tau = 2 * 2.5 per 10 ms = 500 tok/s
    policy.plan(confident, slots, gens)
    policy.observe(torch.tensor([1, 2], device=device))  # 0.5 accepted per request: (1.5 + 0.5) / 2 = 1.0
    assert not policy.speculate(slots, gens)  # tau = 2 * 2 per 10 ms = 400 tok/s: not more than plain
    mean = Adaptive(policy.planner, plain_seconds=lambda b: b / 400.0, feedback=FeedbackSettings(decay=0.8 ** 0.5, prior_weight=0))
    for commit in ([1, 1], [GAMMA + 1, GAMMA + 1], [GAMMA + 1, GAMMA + 1]):
        mean.plan(confident, slots, gens)
        mean.observe(torch.tensor(commit, device=device))
    assert mean.realised == pytest.approx((2.0, GAMMA))  # first outcomes: their plain mean (0, 3, 3)
    off = Adaptive(policy.planner, plain_seconds=lambda b: b / 400.0, feedback=FeedbackSettings(decay=None))
    assert off.speculate(slots, gens)  # the lagged survival alone (~1) speculates
    off.plan(confident, slots, gens)
    off.observe(torch.tensor([1, 1], device=device))
    assert off.realised is None and off.speculate(slots, gens)


def test_plain_steps_pull_the_realised_average_back_to_the_long_run_mean(device) -> None:
    """A plain step observes nothing: its B outcomes count as the long-run mean, so a short bad streak sends
    a small batch plain for a few steps only (the replay found B = 2 stuck plain behind one streak)."""
    from types import SimpleNamespace

    slots, gens = torch.tensor([0, 1], device=device), torch.tensor([1, 1], device=device)
    policy = Adaptive(_planner(device=device), plain_seconds=lambda b: b / 400.0, gate=GateSettings(max_probe_every=64, probe_every=64), feedback=FeedbackSettings(decay=0.5 ** 0.5, prior_weight=0))
    confident = torch.full((2, GAMMA), 8.0, device=device)
    for commit in [[GAMMA + 1, GAMMA + 1]] * 3 + [[1, 1]] * 3:  # long-run mean 1.5 accepted; then a streak
        policy.plan(confident, slots, gens)
        policy.observe(torch.tensor(commit, device=device))
    assert policy.realised[0] < 1.0 and not policy.speculate(slots, gens)  # 3 * (1 + r) / 10 ms < 400 tok/s
    plain = SimpleNamespace(speculated=False, requests=slots)
    steps = 0
    while not policy.speculate(slots, gens):  # each plain step halves the distance to the mean (1.5)
        policy.observe(torch.ones(2, dtype=torch.int64), plain)
        steps += 1
        assert steps < 5
    assert steps == 2 and policy.realised[0] == pytest.approx(1.5 - (1.5 - 0.375) * 0.25)


def test_realised_cost_feedback_follows_measured_step_times(device) -> None:
    """Profiled: speculative 10 ms, plain 5 ms for 2 requests. With survival 0.9, speculation predicts
    tau ~ 7.4 per 10 ms (740 tok/s) vs plain 400 tok/s. If speculative steps then measure 3x their prediction
    (247 tok/s), the next decision goes plain; if plain steps measure 3x theirs too, speculation is back."""
    planner = _planner(device=device)
    slots, gens = torch.tensor([0, 1], device=device), torch.tensor([1, 1], device=device)
    policy = Adaptive(planner, plain_seconds=lambda b: b / 400.0, gate=GateSettings(cost_window=1))
    sure = torch.full((2, GAMMA), 3.0, device=device)  # sigmoid ~0.95 per position
    assert policy.speculate(slots, gens)
    policy.plan(sure, slots, gens)
    policy.observe_seconds(3 * STEP)  # the speculative step took 3x the profiled 10 ms
    assert policy.gate.cost_ratio[True] == pytest.approx(3.0)
    assert not policy.speculate(slots, gens)
    policy.observe_seconds(3 * 2 / 400.0)  # the plain step took 3x its profile too
    assert policy.gate.cost_ratio[False] == pytest.approx(3.0)
    assert policy.speculate(slots, gens)  # the new median re-decides at once, not at the next probe or plan
    policy.plan(sure, slots, gens)
    policy.observe_seconds(100 * STEP)  # right after plain steps: the draft's catch-up, not sampled
    assert policy.gate.cost_ratio[True] == pytest.approx(3.0)
    assert policy.speculate(slots, gens)
    policy.plan(sure, slots, gens)
    policy.observe_seconds(STEP)  # a speculative step after a speculative step is
    assert policy.gate.cost_ratio[True] == pytest.approx(1.0)
    policy.speculate(slots, gens)
    policy.plan(sure, slots, gens)
    samples = list(policy.gate._samples[True])
    policy.observe_seconds(9 * STEP, prefill_tokens=5)  # a refill's prompt rode the step (chunked prefill) and
    assert list(policy.gate._samples[True]) == samples and not policy.gate._steps  # its price is unknown
    priced = Adaptive(planner, plain_seconds=lambda b: b / 400.0, gate=GateSettings(prefill_token_seconds=STEP / 5))
    for _ in range(3):  # with the prompt's price the step's prediction holds its rows: measured 2 x (STEP + STEP)
        priced.plan(sure, slots, gens)
        priced.observe_seconds(4 * STEP, prefill_tokens=5)
    assert priced.gate.cost_ratio[True] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="prefill_token_seconds"):
        GateSettings(prefill_token_seconds=-1.0)
    median = Adaptive(planner, plain_seconds=lambda b: b / 400.0, gate=GateSettings(cost_window=3))  # median of the last 3
    for measured, ratio in ((1.2, 1.0), (10.0, 1.0), (1.0, 1.2), (1.1, 1.1)):  # from 3 samples; a 10x stall: no
        median.plan(sure, slots, gens)
        median.observe_seconds(measured * STEP)
        assert median.gate.cost_ratio[True] == pytest.approx(ratio)
    off = Adaptive(planner, plain_seconds=lambda b: b / 400.0, gate=GateSettings(cost_window=None))
    off.speculate(slots, gens)
    off.plan(sure, slots, gens)
    off.observe_seconds(3 * STEP)
    assert off.gate.cost_ratio[True] == 1.0
    with pytest.raises(ValueError, match="cost_window must be"):
        Adaptive(planner, plain_seconds=lambda b: 0.01, gate=GateSettings(cost_window=0))


def _plain_runs(out) -> list[int]:
    """Lengths of the runs of plain steps between speculative steps."""
    return [len(r) for r in "".join("s" if x else "p" for x in _speculated(out)).split("s")]


def test_probe_every_n_plain_steps(decoder: SpecDecoder) -> None:
    n = 3
    # plain wins; cost_window=None: the decision must follow these predictions, not the measured step times
    policy = Adaptive(_planner(device=decoder.device), plain_seconds=lambda b: 1e-6, gate=GateSettings(probe_every=n, max_probe_every=n, cost_window=None, probe_budget=None))  # the interval alone
    out = decoder.generate(_prompts(3, 5), 14, policy, mode="compact")
    runs = _plain_runs(out)
    assert runs[0] == n and all(r == n for r in runs[:-1]) and len(runs) >= 3 and runs[-1] <= n
    assert all(s.times.plan > 0 for s in out.steps)  # the decision's time is charged


def test_a_timed_probe_finds_out_that_the_profile_overpriced_speculation(device) -> None:
    """Profiled: speculative 10 ms, plain 5 ms for 2 requests; survival 0.5 / 0.25 / 0.125 predicts tau 3.75
    per 10 ms (375 tok/s) < 400 tok/s plain, so after the first step only probes speculate. A speculative
    step really takes 5 ms (750 tok/s). A probe is two steps: the first catches up (not timed), the second
    is timed; with three timed steps the median ratio 0.5 puts speculation ahead for good."""
    planner = _planner(device=device)
    slots, gens = torch.tensor([0, 1], device=device), torch.tensor([1, 1], device=device)
    policy = Adaptive(planner, plain_seconds=lambda b: b / 400.0, gate=GateSettings(probe_every=2, max_probe_every=2, cost_window=3), feedback=FeedbackSettings(decay=None))
    half = torch.zeros(2, GAMMA, device=device)  # conditional 0.5 per position

    def step() -> str:
        if policy.speculate(slots, gens):
            policy.plan(half, slots, gens)
            policy.observe_seconds(STEP / 2)
            return "s"
        policy.observe_seconds(2 / 400.0)  # plain steps take what the profile said
        return "p"

    trace = "".join(step() for _ in range(14))
    assert trace == "s" + "pp" + "ss" + "pp" + "ss" + "sssss", trace
    assert policy.gate.cost_ratio == {True: pytest.approx(0.5), False: pytest.approx(1.0)}
    untimed = Adaptive(planner, plain_seconds=lambda b: b / 400.0, gate=GateSettings(probe_every=2, max_probe_every=2, cost_window=None), feedback=FeedbackSettings(decay=None))  # no cost feedback: one-step probes
    policy = untimed  # the ring already holds survival 0.5: plain from the start
    assert "".join(step() for _ in range(9)) == "pp" + "s" + "pp" + "s" + "pp" + "s"


def test_probe_interval_backs_off_while_plain_keeps_winning(decoder: SpecDecoder) -> None:
    policy = Adaptive(_planner(device=decoder.device), plain_seconds=lambda b: 1e-6, gate=GateSettings(probe_every=2, max_probe_every=8, cost_window=None, probe_budget=None))  # the interval alone
    out = decoder.generate(_prompts(2, 5), 40, policy, mode="compact")
    runs = _plain_runs(out)
    assert runs[:4] == [2, 4, 8, 8]


def test_speculates_every_step_when_it_pays(decoder: SpecDecoder) -> None:
    policy = Adaptive(_planner(device=decoder.device), plain_seconds=lambda b: 10.0, gate=GateSettings(cost_window=None))  # plain: 10 s per step
    out = decoder.generate(_prompts(3, 5), 10, policy, mode="compact")
    assert all(_speculated(out))


@pytest.mark.parametrize("mode", [m.value for m in VerifyMode])
@pytest.mark.parametrize("plain", [1e-6, 0.02, 10.0])
def test_lossless_whatever_the_decision(decoder: SpecDecoder, mode: str, plain: float) -> None:
    prompts = _prompts(4, 6, seed=3)
    ref = decoder.generate(prompts, 16, FixedK(0), mode="static")
    out = decoder.generate(prompts, 16, Adaptive(_planner(device=decoder.device), lambda b: plain * b, gate=GateSettings(probe_every=2)), mode=mode)
    assert torch.equal(out.tokens, ref.tokens), (mode, plain)


def test_bad_arguments(device) -> None:
    with pytest.raises(ValueError, match="probe_every"):
        Adaptive(_planner(device=device), lambda b: 1.0, gate=GateSettings(probe_every=0))
    with pytest.raises(ValueError, match="feedback decay must be"):
        Adaptive(_planner(device=device), lambda b: 1.0, feedback=FeedbackSettings(decay=1.0))
    with pytest.raises(ValueError, match="max_probe_every"):
        Adaptive(_planner(device=device), lambda b: 1.0, gate=GateSettings(probe_every=4, max_probe_every=2))
    assert Adaptive(_planner(lag=0, device=device)).speculate(torch.tensor([0], device=device), torch.tensor([1], device=device))  # no plain cost: always


def test_one_request_moves_the_average_less_than_a_batch(device) -> None:
    """Per request outcome: a step of 1 request with nothing accepted moves the average by 1 - decay, a step
    of 4 requests by 1 - decay ** 4, so a short run of rejections at B = 1 cannot swing the decision."""
    confident = torch.full((4, GAMMA), 8.0, device=device)
    moved = {}
    for b in (1, 4):
        slots, gens = torch.arange(b, device=device), torch.ones(b, dtype=torch.int64, device=device)
        policy = Adaptive(_planner(lag=0, device=device), lambda n: n / 400.0, feedback=FeedbackSettings(decay=0.9, prior_weight=0))
        for _ in range(30):  # all accepted: the average sits at GAMMA
            policy.plan(confident[:b], slots, gens)
            policy.observe(torch.full((b,), GAMMA + 1))
        policy.plan(confident[:b], slots, gens)
        policy.observe(torch.ones(b, dtype=torch.int64))  # none accepted
        moved[b] = GAMMA - policy.realised[0]
    assert moved[1] == pytest.approx(GAMMA * 0.1)
    assert moved[4] == pytest.approx(GAMMA * (1 - 0.9 ** 4))


def test_lag0_speculates_until_outcomes_then_follows_them(device) -> None:
    """A lag-0 planner has no lagged survival: speculate first, then decide on the realised averages."""
    slots, gens = torch.tensor([0, 1], device=device), torch.tensor([1, 1], device=device)
    policy = Adaptive(_planner(lag=0, device=device), lambda b: b / 400.0, feedback=FeedbackSettings(decay=0.0))  # plain: 400 tok/s
    assert policy.speculate(slots, gens)
    policy.plan(torch.full((2, GAMMA), 8.0, device=device), slots, gens)
    policy.observe(torch.tensor([1, 1], device=device))  # nothing accepted: tau = 2 per 10 ms
    assert not policy.speculate(slots, gens)


def test_prior_from_the_first_prediction_outweighs_one_unlucky_outcome(device) -> None:
    """The averages start at the first planned step's calibrated prediction, worth `prior_weight` request
    outcomes: a confident head (every draft expected) and one step with nothing accepted stay speculative;
    without the prior that one outcome alone sends the policy plain."""
    slots, gens = torch.tensor([0, 1], device=device), torch.tensor([1, 1], device=device)
    confident = torch.full((2, GAMMA), 8.0, device=device)  # survival ~1 at every position: ~GAMMA accepted predicted
    for prior_weight, speculates in ((8, True), (0, False)):
        policy = Adaptive(_planner(lag=0, device=device), lambda b: b / 400.0, feedback=FeedbackSettings(prior_weight=prior_weight))  # plain: 400 tok/s
        assert policy.speculate(slots, gens)
        policy.plan(confident, slots, gens)
        policy.observe(torch.tensor([1, 1], device=device))  # nothing accepted
        if prior_weight:
            expected = float((torch.sigmoid(torch.tensor(8.0, device=device)).double() ** torch.arange(1, GAMMA + 1, device=device)).sum())
            assert policy.realised == pytest.approx((0.8 * expected, GAMMA))  # (8 x prior + 2 x 0) / 10
        assert policy.speculate(slots, gens) is speculates


@pytest.mark.cpu_only(reason="host arithmetic of the plain-step cost table")
def test_plain_step_cost_interpolates() -> None:
    cost = PlainStepCost((1, 4, 16), (0.004, 0.005, 0.011))
    assert cost.step_seconds(1) == 0.004 and cost.step_seconds(16) == 0.011
    assert cost.step_seconds(10) == pytest.approx(0.008)
    assert cost.step_seconds(32) == pytest.approx(0.022)  # beyond the largest: proportional to B
    with pytest.raises(ValueError, match="increasing"):
        PlainStepCost((4, 1), (0.1, 0.2))
    with pytest.raises(ValueError, match="positive"):
        PlainStepCost((1, 4), (0.1, 0.0))


def test_prior_is_the_mean_of_every_plans_prediction(device) -> None:
    """The long-run mean plain steps pull toward shrinks the outcomes to the mean calibrated prediction of
    all plans so far, not of the first alone: a cautious first plan does not anchor the decision for good
    (the replay found B = 4 on the CPU model kept plain behind one such plan)."""
    from types import SimpleNamespace

    slots, gens = torch.tensor([0, 1], device=device), torch.tensor([1, 1], device=device)
    policy = Adaptive(_planner(lag=0, device=device), lambda b: b / 400.0, feedback=FeedbackSettings(prior_weight=8))
    predicted = []
    for logit, commit in ((0.0, [1, 1]), (8.0, [GAMMA + 1, GAMMA + 1])):  # predicts 0.875 then ~3 accepted
        plan = policy.plan(torch.full((2, GAMMA), logit, device=device), slots, gens)
        assert torch.equal(plan.verify_lens.cpu(), torch.full((2,), GAMMA + 1, dtype=torch.int32))
        predicted.append(float((torch.sigmoid(torch.tensor(logit)).double() ** torch.arange(1, GAMMA + 1)).sum()))
        policy.observe(torch.tensor(commit, device=device))
    plain = SimpleNamespace(speculated=False, requests=slots)
    for _ in range(2000):
        policy.observe(torch.ones(2, dtype=torch.int64), plain)
    observed = (0 + 0 + GAMMA + GAMMA) / 4  # four request outcomes
    long_run = (4 * observed + 8 * sum(predicted) / 2) / (4 + 8)
    assert policy.realised[0] == pytest.approx(long_run, rel=1e-6)
    assert policy.realised[1] == pytest.approx(GAMMA, rel=1e-6)


@pytest.mark.parametrize("plain_rate, speculates", [(115.0, True), (135.0, False)])
def test_a_depth_is_priced_over_the_rows_its_steps_verify_not_at_their_mean(device, plain_rate, speculates) -> None:
    """One request, gamma 2, steps of 1 / 2 / 3 rows cost 10 / 20 / 21 ms. Half its steps verified both drafts and
    accepted them, half the root alone: 2 tokens a step for 0.5 x 10 + 0.5 x 21 ms, 129 tok/s. The table at the
    mean rows (2, 20 ms) would say 100 tok/s and go plain against 115."""
    cost = TieredCostModel(0.0, BatchTerm([1], [0.0]), TierTerm([1, 2, 3], [0.010, 0.020, 0.021]), width=3)
    planner = VerifyPlanner(ScheduleConfig(gamma=2), cost, PlannerSettings(lag=0), device=device)
    policy = Adaptive(planner, lambda b: b / plain_rate, feedback=FeedbackSettings(decay=0.5, prior_weight=0))
    policy.feedback.observe_plan([3], [[1.0, 1.0]], [3])
    policy.feedback.observe_plan([1], [[1.0, 1.0]], [1])
    assert policy.realised == pytest.approx((1.0, 1.0))
    assert policy.depth_rates(1) == pytest.approx({2: 2 / 0.0155})
    slots, gens = torch.tensor([0], device=device), torch.tensor([1], device=device)
    assert policy.speculate(slots, gens) is speculates


def test_depth_rates_of_a_batch_price_the_mean_budget_and_one_request_within_its_cap(device) -> None:
    """From B = 2 each depth is priced at the filled window's price of its mean budget (the rule before one
    request's distribution); one request whose planner caps its verify length below gamma + 1 is priced within
    the cap."""
    cost = TieredCostModel(1e-3, BatchTerm([1, 16], [0.0, 4e-3]), TierTerm([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64],
                                                                          [0.0, 2e-3, 3e-3, 5e-3, 6e-3, 8e-3, 9e-3,
                                                                           1.2e-2, 1.5e-2, 1.7e-2, 2.2e-2, 2.6e-2]))
    planners = {k: VerifyPlanner(ScheduleConfig(gamma=k), cost, PlannerSettings(lag=0), device=device)
                for k in range(1, GAMMA + 1)}
    policy = Adaptive(planners[GAMMA], lambda b: b / 100.0, GateSettings(catch_up_seconds=1e-4),
                      FeedbackSettings(decay=0.9, prior_weight=0), depths={1: planners[1], 2: planners[2]})
    with pytest.raises(ValueError, match="outcome first"):
        policy.depth_rates(2)
    policy.feedback.observe_plan([4, 2, 1, 3], [[0.9, 0.6, 0.3]] * 4, [3, 2, 1, 1])
    policy.feedback.observe_plan([2, 4], [[0.8, 0.5, 0.2]] * 2, [2, 4])
    accepted, verified = policy.feedback.by_depth()
    for b in (2, 4, 16):
        want = {}
        for k, planner in planners.items():
            window = planner.filled_seconds_window(b)
            budget = min(max(0, round(b * (1 + verified[k - 1])) - b), b * k)
            want[k] = b * (1 + accepted[k - 1]) / (window[budget] + 1e-4 * b * accepted[k - 1])
        assert policy.depth_rates(b) == want  # to the last bit
    capped = VerifyPlanner(ScheduleConfig(gamma=GAMMA, max_verify_len=2), cost, PlannerSettings(lag=0), device=device)
    one = Adaptive(capped, lambda b: b / 100.0, feedback=FeedbackSettings(decay=0.9, prior_weight=0))
    one.feedback.observe_plan([2, 1], [[0.9, 0.6, 0.3]] * 2, [2, 1])  # half verify one draft, half the root
    window = capped.filled_seconds_window(1)
    assert len(window) == 2 and one.depth_rates(1) == pytest.approx({GAMMA: 1.5 / (0.5 * window[0] + 0.5 * window[1])})


@pytest.mark.parametrize("catch_up, speculates", [(0.0, True), (0.001, True), (0.002, False)])
def test_the_drafters_catch_up_of_accepted_drafts_is_priced(device, catch_up: float, speculates: bool) -> None:
    """Every draft accepted: a speculative step commits 2 x 4 tokens in 10 ms, plus the next step's catch-up of
    its 2 x 3 accepted drafts at `catch_up` s per token: 800 / 500 / 364 tok/s against plain's 400."""
    slots, gens = torch.tensor([0, 1], device=device), torch.tensor([1, 1], device=device)
    policy = Adaptive(_planner(lag=0, device=device), lambda b: b / 400.0, GateSettings(catch_up_seconds=catch_up),
                      FeedbackSettings(decay=0.5, prior_weight=0))
    policy.plan(torch.full((2, GAMMA), 8.0, device=device), slots, gens)
    policy.observe(torch.full((2,), GAMMA + 1, device=device))
    assert policy.realised == pytest.approx((GAMMA, GAMMA))
    assert policy.speculate(slots, gens) is speculates


@pytest.mark.cpu_only(reason="validates a settings object")
@pytest.mark.parametrize("value", [-1e-6, float("nan"), float("inf"), True])
def test_a_bad_catch_up_price_names_itself(value) -> None:
    with pytest.raises(ValueError, match="catch_up_seconds"):
        GateSettings(catch_up_seconds=value)


@pytest.mark.parametrize("plain_rate, whole", [(820.0, True), (1000.0, False)])
def test_a_close_call_is_probed_whole_a_clear_one_a_few_requests_in_turn(device, plain_rate: float, whole: bool) -> None:
    """4 requests, lag 0: the first step knows nothing and drafts for all. Each drafting request commits 2 of
    its 4 rows: 1 accepted of 3 verified, 2 tokens per 10 ms step, 800 tok/s.
    Against 820 tok/s plain (2.4 % behind, within `full_probe_within` = 5 %) a probe drafts for every request;
    against 1,000 tok/s (20 % behind) for one of them, the next one at each probe."""
    slots, gens = torch.arange(4, device=device), torch.ones(4, dtype=torch.int64, device=device)
    gate = GateSettings(probe_every=2, max_probe_every=2, cost_window=None, probe_requests=1, probe_budget=None)
    policy = Adaptive(_planner(lag=0, device=device), plain_seconds=lambda b: b / plain_rate, gate=gate,
                      feedback=FeedbackSettings(prior_weight=0))
    assert policy.catch_up is None  # a request may wait its whole length for its first proposal
    masks = []
    for _ in range(10):
        if policy.speculate(slots, gens):
            masks.append(None if policy.drafting is None else policy.drafting.int().tolist())
            policy.plan(torch.zeros(4, GAMMA, device=device), slots, gens)
            policy.observe(torch.full((4,), 2))
        policy.observe_seconds(0.01)
    if whole:
        assert masks == [None] * 4
    else:
        assert masks == [None, [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]]
    # the realised acceptance counts the requests that drafted only: 4 + 4 + 4 + 4, or 4 + 1 + 1 + 1
    assert policy.feedback.counts == [16 if whole else 7] * GAMMA
    assert Adaptive(_planner(device=device), lambda b: 1.0, gate=gate, feedback=FeedbackSettings(decay=None)
                    ).gate.settings.probe_requests is None  # without the feedback a probe drafts for every request


def test_partial_probes_run_lossless_and_report_who_drafted(decoder: SpecDecoder) -> None:
    prompts = _prompts(4, 6, seed=5)
    ref = decoder.generate(prompts, 16, FixedK(0), mode="static")
    gate = GateSettings(probe_every=2, max_probe_every=2, cost_window=None, probe_requests=1, probe_budget=None)
    policy = Adaptive(_planner(device=decoder.device), plain_seconds=lambda b: 1e-6, gate=gate)
    out = decoder.generate(prompts, 16, policy, mode="compact")
    assert torch.equal(out.tokens, ref.tokens)
    probes = [s for s in out.steps if s.speculated][1:]
    assert len(probes) >= 3 and all(s.drafting == 1 for s in probes)
    for s in probes:  # the requests that did not draft verify their root only
        undrafted = s.confidence_logits[:, 0] == float("-inf")
        assert int(undrafted.sum()) == s.requests.numel() - 1
        assert bool((s.plan.verify_lens[undrafted] == 1).all())


@pytest.mark.cpu_only(reason="settings validation")
def test_bad_probe_settings() -> None:
    with pytest.raises(ValueError, match="probe_requests must be .*got 0"):
        GateSettings(probe_requests=0)
    with pytest.raises(ValueError, match="full_probe_within"):
        GateSettings(full_probe_within=-0.1)


def test_the_estimator_learns_from_the_requests_that_drafted_only(decoder: SpecDecoder) -> None:
    """A static verify checks every request's k rows, the fillers of those that did not draft too; the online
    estimator takes labels from the drafting requests alone: one position-0 label per drafting request per step."""
    prompts = _prompts(4, 6, seed=6)
    ref = decoder.generate(prompts, 16, FixedK(0), mode="static")
    est = OnlineAcceptanceEstimator(GAMMA, refit_every=2, min_labels=4)
    gate = GateSettings(probe_every=2, max_probe_every=2, cost_window=None, probe_requests=1, probe_budget=None)
    policy = Adaptive(_planner(lag=0, device=decoder.device), plain_seconds=lambda b: 1e-6, gate=gate, estimator=est)
    out = decoder.generate(prompts, 16, policy, mode="static")
    assert torch.equal(out.tokens, ref.tokens)
    spec = [s for s in out.steps if s.speculated]
    assert any(s.drafting < s.requests.numel() for s in spec)
    assert est.labels_seen[0] == sum(s.drafting for s in spec)


@pytest.mark.parametrize("mask, got", [(lambda b: torch.ones(b + 1, dtype=torch.bool), r"torch.bool \[4\]"),
                                       (lambda b: torch.ones(b, dtype=torch.int64), r"torch.int64 \[3\]"),
                                       (lambda b: [True] * b, r"\[True, True, True\]")])
def test_a_policys_drafting_mask_of_the_wrong_shape_or_type_is_refused(decoder: SpecDecoder, mask, got) -> None:
    class Bad(FixedK):
        def speculate(self, slots, generations):
            self.drafting = mask(slots.numel())
            return True
    with pytest.raises(ValueError, match=rf"policy 'fixed-2' set drafting to {got}.*CPU bool tensor \[B=3\]"):
        decoder.generate(_prompts(3, 5), 4, Bad(2))


def test_a_live_argmax_policy_decodes_greedy_and_refuses_to_sample(decoder: SpecDecoder) -> None:
    """A lag-0 planner's live argmax reads each draft's own survival: lossless under greedy acceptance only, so the
    engine serves it greedy (the target's own tokens) and refuses a sampling run, naming the temperature."""
    cost = StepsPerSecondTable([1, 8], [1 / STEP, 0.5 / STEP], width=GAMMA + 1)
    planner = VerifyPlanner(ScheduleConfig(gamma=GAMMA), cost, PlannerSettings(lag=0, live_argmax=True),
                            device=decoder.device)
    policy = Adaptive(planner)
    assert policy.greedy_only and not Adaptive(_planner(lag=0, device=decoder.device)).greedy_only
    prompts = _prompts(3, 5, seed=2)
    assert torch.equal(decoder.generate(prompts, 12, policy).tokens, decoder.generate(prompts, 12, FixedK(0)).tokens)
    with pytest.raises(ValueError, match=r"policy 'adaptive' plans with PlannerSettings\(live_argmax=True\).*"
                                         r"temperature 0\.7"):
        decoder.generate(prompts, 4, Adaptive(planner), SamplingParams(temperature=0.7))
    scanned = decoder.generate(prompts, 4, Adaptive(_planner(lag=0, device=decoder.device)),
                               SamplingParams(temperature=0.7))  # the scan samples
    assert int(scanned.num_tokens.sum()) == 3 * 4
