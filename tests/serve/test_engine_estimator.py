"""The engine with the draft's confidence head disabled and the online acceptance estimator in its place
(`Adaptive(..., estimator=...)`): lossless, the head never runs, the planner sees the estimator's logits,
the estimator learns from exactly the STS-censored outcomes of the speculative steps, sampling runs."""
from __future__ import annotations

import pytest
import torch

from dspark import OnlineAcceptanceEstimator, draft_features
from dspark.calibration.recorder import censored_labels
from dspark.config import ScheduleConfig
from dspark.cost import StepsPerSecondTable
from dspark.plan.planner import PlannerSettings, VerifyPlanner
from dspark.serve.config import EngineConfig, SamplingParams
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import Adaptive, FixedK
from tests.engine_models import tiny_models
from tests.serve.test_engine import _prompts

pytestmark = pytest.mark.usefixtures("one_thread")

GAMMA = 3


def _planner(device: torch.device, temperatures: list[float] | None = None, gamma: int = GAMMA) -> VerifyPlanner:
    cost = StepsPerSecondTable([1, 8, 16], [100.0, 90.0, 70.0], width=gamma + 1)
    return VerifyPlanner(ScheduleConfig(gamma=gamma), cost, PlannerSettings(lag=1, num_slots=8), device=device,
                         temperatures=temperatures)


@pytest.fixture(scope="module")
def decoder(device) -> SpecDecoder:
    target, draft = tiny_models(gamma=GAMMA)
    return SpecDecoder(target, draft, config=EngineConfig(cache_tokens=4096, page_size=8, device=device))


def _no_head(*_: object) -> None:
    raise AssertionError("the confidence head ran although the estimator replaces it")


@pytest.mark.parametrize("mode", ["compact", "static"])
def test_estimator_in_place_of_the_head_is_lossless_and_learns(decoder: SpecDecoder, monkeypatch, mode: str):
    prompts = _prompts(4, 6, seed=5)
    ref = decoder.generate(prompts, 20, FixedK(0), mode="static")
    est = OnlineAcceptanceEstimator(GAMMA, refit_every=2, min_labels=4)
    monkeypatch.setattr(decoder.draft, "confidence_logits", _no_head)
    out = decoder.fork(keep_draft_logits=True).generate(prompts, 20, Adaptive(_planner(decoder.device), estimator=est),
                                                        mode=mode)
    assert torch.equal(out.tokens, ref.tokens)
    spec = [s for s in out.steps if s.speculated]
    assert spec and est.steps_observed == len(spec) and est.refits == len(spec) // 2
    assert not torch.equal(est.parameters, est.prior)  # the refits moved it off the warm-up prior
    want = torch.zeros(GAMMA, dtype=torch.int64)
    for s in spec:
        y = censored_labels(s.caps.cpu(), GAMMA, correct_lens=s.correct_lens.cpu())
        reached = torch.isfinite(y) & torch.cat([torch.ones(y.shape[0], 1, dtype=torch.bool), y[:, :-1] == 1], 1)
        want += (reached & torch.isfinite(draft_features(s.draft_logits.cpu())).all(-1)).sum(0)
    assert est.labels_seen.tolist() == want.tolist()
    assert int(want.sum()) > 0


def test_planner_sees_the_estimators_logits(decoder: SpecDecoder, monkeypatch):
    """Replaying the run's steps through a second estimator fed the same outcomes gives the very logits
    the planner received at every step (the same parameters at every refit)."""
    est = OnlineAcceptanceEstimator(GAMMA, refit_every=3, min_labels=4)
    monkeypatch.setattr(decoder.draft, "confidence_logits", _no_head)
    out = decoder.fork(keep_draft_logits=True).generate(_prompts(3, 6, seed=8), 16,
                                                        Adaptive(_planner(decoder.device), estimator=est))
    replay = OnlineAcceptanceEstimator(GAMMA, refit_every=3, min_labels=4)
    for s in out.steps:
        if not s.speculated:
            continue
        assert torch.equal(replay.confidence_logits(s.draft_logits).cpu(), s.confidence_logits.cpu())
        replay.observe(verify_lens=s.caps, correct_lens=s.correct_lens)
    assert torch.equal(replay.parameters, est.parameters)


def test_sampling_with_the_estimator_runs_and_is_seeded(decoder: SpecDecoder, monkeypatch):
    monkeypatch.setattr(decoder.draft, "confidence_logits", _no_head)
    runs = []
    for _ in range(2):
        est = OnlineAcceptanceEstimator(GAMMA, refit_every=2, min_labels=4)
        out = decoder.generate(_prompts(3, 6, seed=9), 12, Adaptive(_planner(decoder.device), estimator=est),
                               sampling=SamplingParams(temperature=0.8, seed=4))
        runs.append((out.tokens, est.parameters))
    assert est.steps_observed > 0
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_estimator_needs_a_matching_uncalibrated_planner(device):
    with pytest.raises(ValueError, match=r"needs a planner with its gamma and temperatures=None, got gamma=3 and "
                                         r"temperatures \[2.0, 2.0, 2.0\]"):
        Adaptive(_planner(device, [2.0] * GAMMA), estimator=OnlineAcceptanceEstimator(GAMMA))
    with pytest.raises(ValueError, match="estimator \\(gamma=4\\).*got gamma=3"):
        Adaptive(_planner(device), estimator=OnlineAcceptanceEstimator(4))
    with pytest.raises(TypeError, match="estimator must be a OnlineAcceptanceEstimator"):
        Adaptive(_planner(device), estimator="margin")
