"""The online acceptance estimator (dspark.calibration.online): features against a float64 reference, STS
censoring of its labels, the warm-up prior, the refit (KKT optimum, recovers a known model, every N steps),
determinism, the survival contract and bad inputs."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark import OnlineAcceptanceEstimator, calibrated_survival, draft_features
from dspark.calibration.online import FEATURE_CAP, fit_logistic, prior_parameters

# tests without the device fixture exercise the host side: the fit runs in float64 numpy on the CPU
pytestmark = pytest.mark.cpu_only(reason="the estimator's fit and label store are host-side by design")


def _logits(b: int, g: int, v: int, seed: int, masked: float = 0.3) -> torch.Tensor:
    """Random draft logits with varied sharpness and a -inf masked part of the vocabulary (as the draft's
    reduced vocabulary scatters), at least two finite entries per row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, g, v, generator=gen) * (0.2 + 8 * torch.rand(b, g, 1, generator=gen))
    mask = torch.rand(b, g, v, generator=gen) < masked
    mask[..., :2] = False
    return x.masked_fill(mask, -math.inf)


def _reference(x: np.ndarray) -> np.ndarray:
    """float64 features of one [V] row of logits."""
    f = x[np.isfinite(x)]
    lse = np.log(np.sum(np.exp(f - f.max()))) + f.max()
    p = np.exp(f - lse)
    top = np.sort(f)[::-1]
    log_odds = (top[0] - lse) - np.log(np.sum(np.exp(top[1:] - lse)))
    return np.array([min(log_odds, FEATURE_CAP), min(top[0] - top[1], FEATURE_CAP), -np.sum(p * np.log(p))])


@settings(max_examples=20)
@given(b=st.integers(1, 5), g=st.integers(1, 6), v=st.integers(2, 300), seed=st.integers(0, 2**16))
def test_features_match_float64_reference(b, g, v, seed, device):
    x = _logits(b, g, v, seed)
    got = draft_features(x.to(device))
    assert got.shape == (b, g, 3) and got.dtype == torch.float32 and got.device.type == device.type
    ref = np.array([[_reference(x[i, k].double().numpy()) for k in range(g)] for i in range(b)])
    np.testing.assert_allclose(got.cpu().double().numpy(), ref, rtol=2e-4, atol=2e-4)


@settings(max_examples=15)
@given(b=st.integers(2, 9), seed=st.integers(0, 2**16))
def test_a_requests_confidence_bits_do_not_depend_on_its_batch(b, seed, device):
    est = _trained_estimator(3, seed)
    x = _logits(b, 3, 97, seed).to(device)
    whole = est.confidence_logits(x).cpu()
    for i in (0, b - 1):
        alone = est.confidence_logits(x[i: i + 1]).cpu()
        assert torch.equal(alone[0], whole[i])


def test_survival_contract_and_nan_logits_give_zero(device):
    est = _trained_estimator(4, 1)
    x = _logits(6, 4, 50, 2)
    x[1, 2, 7] = math.nan
    x[3, 0] = -math.inf  # no finite entry at all
    x = x.to(device)
    s = est.survival(x)
    z = est.confidence_logits(x)
    assert s.dtype == torch.float32 and s.shape == (6, 4)
    assert torch.equal(s.cpu(), calibrated_survival(z.cpu()))
    assert bool((s[:, 1:] <= s[:, :-1]).all()) and bool(((s >= 0) & (s <= 1)).all())
    assert s[1, 2:].abs().sum() == 0 and s[3].abs().sum() == 0 and bool((s[0] > 0).all())
    seen = est.labels_seen.copy()
    est.observe(verify_lens=torch.full((6,), 5), correct_lens=torch.full((6,), 4))
    assert (est.labels_seen - seen).tolist() == [5, 6, 5, 6]  # a position with NaN features is not a label


def test_empty_batch_is_empty(device):
    est = OnlineAcceptanceEstimator(3)
    x = torch.zeros(0, 3, 10, device=device)
    assert est.survival(x).shape == (0, 3) and est.confidence_logits(x).shape == (0, 3)
    est.observe(verify_lens=torch.zeros(0, dtype=torch.int64), correct_lens=torch.zeros(0, dtype=torch.int64))
    assert est.steps_observed == 1 and est.labels_seen.sum() == 0


def test_warm_up_prior_is_the_drafts_top1_probability(device):
    est = OnlineAcceptanceEstimator(3, refit_every=1, min_labels=50)
    x = _logits(4, 3, 40, 5).to(device)
    p1 = torch.softmax(x.cpu().double(), -1).amax(-1).float()
    torch.testing.assert_close(est.survival(x).cpu(), torch.cumprod(p1, 1), rtol=1e-5, atol=1e-6)
    est.observe(verify_lens=torch.full((4,), 4), correct_lens=torch.tensor([3, 0, 1, 2]))
    assert torch.equal(est.parameters, prior_parameters(3)) and est.refits == 1  # 4 labels < 50: still the prior


@settings(max_examples=25)
@given(data=st.data())
def test_labels_are_censored_like_sts(data, device):
    """Position k is a label iff k < verify_len - 1 (verified) and k <= correct_lens (no earlier rejection);
    its value is k < correct_lens. verify_lens and correct_lens come from the generated case itself."""
    g = data.draw(st.integers(1, 6))
    b = data.draw(st.integers(1, 8))
    vl = data.draw(st.lists(st.integers(1, g + 1), min_size=b, max_size=b))
    cl = [data.draw(st.integers(0, g)) for _ in range(b)]
    est = OnlineAcceptanceEstimator(g, window=64, min_labels=1, refit_every=10**6)
    est.confidence_logits(_logits(b, g, 20, data.draw(st.integers(0, 999))).to(device))
    est.observe(verify_lens=torch.tensor(vl), correct_lens=torch.tensor(cl))
    for k in range(g):
        want = [float(k < c) for v, c in zip(vl, cl) if k < v - 1 and k <= c]
        assert est.labels_seen[k] == len(want)
        assert est._y[k, : len(want)].tolist() == want


def test_labels_or_correct_len_give_the_same_model():
    a, b = OnlineAcceptanceEstimator(4, min_labels=1), OnlineAcceptanceEstimator(4, min_labels=1)
    x = _logits(5, 4, 30, 3)
    cl = torch.tensor([0, 4, 2, 1, 3])
    for est, kw in ((a, {"correct_lens": cl}), (b, {"labels": (torch.arange(4) < cl[:, None]).int()})):
        est.confidence_logits(x)
        est.observe(verify_lens=torch.tensor([5, 5, 3, 2, 1]), **kw)
    assert torch.equal(a.refit(), b.refit())


@settings(max_examples=20)
@given(n=st.integers(5, 200), strength=st.sampled_from([0.01, 1.0, 30.0]), seed=st.integers(0, 2**16))
def test_fit_is_the_map_optimum(n, strength, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)) * [4, 3, 2]
    y = (rng.random(n) < 1 / (1 + np.exp(-(x[:, 0] - 0.5)))).astype(float)
    prior = np.array([0.0, 1.0, 0.0, 0.0])
    theta = fit_logistic(x, y, prior, strength)
    a = np.c_[np.ones(n), x]
    grad = a.T @ (1 / (1 + np.exp(-(a @ theta))) - y) + strength * (theta - prior)
    assert np.abs(grad).max() < 1e-6 * max(1.0, n)


def _stream(est: OnlineAcceptanceEstimator, steps: int, seed: int, b: int = 16, v: int = 60) -> None:
    """Synthetic outcomes whose true conditional acceptance is sigmoid(1.5 * log-odds(p1) - 1 + 0.4 k)."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = _logits(b, est.gamma, v, seed * 1000 + step)
        est.confidence_logits(x)
        f = draft_features(x)
        c = torch.sigmoid(1.5 * f[..., 0] - 1 + 0.4 * torch.arange(est.gamma))
        acc = (torch.rand(b, est.gamma, generator=gen) < c).to(torch.int64)
        est.observe(verify_lens=torch.randint(1, est.gamma + 2, (b,), generator=gen),
                    correct_lens=torch.cumprod(acc, 1).sum(1))


def _trained_estimator(g: int, seed: int) -> OnlineAcceptanceEstimator:
    est = OnlineAcceptanceEstimator(g, refit_every=5, min_labels=20)
    _stream(est, 30, seed)
    return est


def test_refit_recovers_a_known_model_every_n_steps():
    est = OnlineAcceptanceEstimator(3, refit_every=7, window=20000, min_labels=100, prior_strength=1.0)
    history = []
    for chunk in range(6):
        _stream(est, 7, 40 + chunk, b=64)
        history.append(est.parameters.clone())
    assert est.refits == 6 and est.steps_observed == 42
    assert not torch.equal(history[-1], history[-2])
    _stream(est, 6, 99, b=64)  # 6 more steps: no refit
    assert torch.equal(est.parameters, history[-1])
    x = _logits(2000, 3, 60, 777)
    truth = torch.sigmoid(1.5 * draft_features(x)[..., 0] - 1 + 0.4 * torch.arange(3))
    error = (torch.sigmoid(est.confidence_logits(x)) - truth).abs().mean(0)
    assert error[:2].max() < 0.03, error  # positions with thousands of labels: the true acceptance


def test_refit_beats_the_prior_on_held_out_outcomes():
    est = OnlineAcceptanceEstimator(2, refit_every=10, min_labels=50)
    _stream(est, 40, 7, b=32)
    held = OnlineAcceptanceEstimator(2, refit_every=10**6)
    x = _logits(4000, 2, 60, 12345)
    f = draft_features(x)
    c = torch.sigmoid(1.5 * f[..., 0] - 1 + 0.4 * torch.arange(2))
    y = (torch.rand(4000, 2, generator=torch.Generator().manual_seed(5)) < c).double()

    def nll(e: OnlineAcceptanceEstimator) -> float:
        p = torch.sigmoid(e.confidence_logits(x).double()).clamp(1e-9, 1 - 1e-9)
        return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())

    assert nll(est) < nll(held) - 0.02


def test_same_stream_gives_bit_identical_parameters():
    a, b = OnlineAcceptanceEstimator(4, refit_every=3, min_labels=10), OnlineAcceptanceEstimator(
        4, refit_every=3, min_labels=10)
    _stream(a, 25, 3)
    _stream(b, 25, 3)
    assert torch.equal(a.parameters, b.parameters) and a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != OnlineAcceptanceEstimator(4, refit_every=4).fingerprint()


def test_window_keeps_the_latest_labels():
    est = OnlineAcceptanceEstimator(1, window=8, min_labels=1, refit_every=10**6)
    for step in range(5):
        est.confidence_logits(_logits(3, 1, 10, step))
        est.observe(verify_lens=torch.full((3,), 2), correct_lens=torch.tensor([step % 2] * 3))
    assert est.labels_seen[0] == 15
    assert sorted(est._y[0].tolist()) == sorted([0.0] * 3 + [1.0] * 3 + [0.0] * 2)  # steps 4, 3 and 2 of step 2


@pytest.mark.parametrize("kwargs, needle", [
    ({"gamma": 0}, "gamma must be an int >= 1, got 0"),
    ({"gamma": 2, "refit_every": 0}, "refit_every must be an int >= 1, got 0"),
    ({"gamma": 2, "window": 10, "min_labels": 11}, "min_labels=11 can never be reached with window=10"),
    ({"gamma": 2, "prior_strength": 0.0}, "prior_strength must be a finite number > 0, got 0.0"),
    ({"gamma": 2, "prior_strength": math.nan}, "prior_strength must be a finite number > 0, got nan"),
])
def test_bad_constructor_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        OnlineAcceptanceEstimator(**kwargs)
    with pytest.raises(TypeError, match="parallel must be a ParallelConfig"):
        OnlineAcceptanceEstimator(2, parallel="tp")


def test_bad_inputs_name_the_value(device):
    est = OnlineAcceptanceEstimator(3)
    with pytest.raises(ValueError, match=r"draft_logits must be \[B, gamma, V\] with V >= 2, got \(2, 3\)"):
        est.confidence_logits(torch.zeros(2, 3, device=device))
    with pytest.raises(ValueError, match=r"V >= 2, got \(2, 3, 1\)"):
        est.confidence_logits(torch.zeros(2, 3, 1, device=device))
    with pytest.raises(ValueError, match=r"\[B, gamma=3, V\], got \(2, 4, 5\)"):
        est.confidence_logits(torch.zeros(2, 4, 5, device=device))
    with pytest.raises(TypeError, match="floating tensor, got dtype torch.int64"):
        est.confidence_logits(torch.zeros(2, 3, 5, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="draft_logits must be a torch.Tensor, got list"):
        est.confidence_logits([[1.0, 2.0]])
    with pytest.raises(RuntimeError, match="needs a confidence_logits"):
        est.observe(verify_lens=torch.ones(2, dtype=torch.int64), correct_lens=torch.zeros(2, dtype=torch.int64))
    x = _logits(2, 3, 9, 0).to(device)
    for kw, err, needle in [
        ({"verify_lens": torch.ones(3, dtype=torch.int64), "correct_lens": torch.zeros(3)}, ValueError,
         r"verify_lens must be a tensor \[B=2\]"),
        ({"verify_lens": torch.tensor([1, 5]), "correct_lens": torch.tensor([0, 0])}, ValueError,
         r"verify_lens must lie in \[1, 4\], got \[1, 5\]"),
        ({"verify_lens": torch.tensor([2, 4]), "correct_lens": torch.tensor([0, 4])}, ValueError,
         r"correct_lens must lie in \[0, 3\], got \[0, 4\]"),
        ({"verify_lens": torch.tensor([2, 4])}, ValueError, "exactly one of correct_lens"),
        ({"verify_lens": torch.tensor([2, 4]), "labels": torch.tensor([[0, 1, 0], [1, 0, 0]])}, ValueError,
         "contiguous prefix"),
        ({"verify_lens": torch.tensor([2, 4]), "correct_lens": torch.tensor([0.5, 1.0])}, TypeError,
         "correct_lens must be an integer or bool tensor"),
    ]:
        est.confidence_logits(x)
        with pytest.raises(err, match=needle):
            est.observe(**kw)


def test_replaying_features_equals_the_live_path(device):
    live, replay = OnlineAcceptanceEstimator(3, refit_every=2, min_labels=5), OnlineAcceptanceEstimator(
        3, refit_every=2, min_labels=5)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        x = _logits(7, 3, 25, 100 + step).to(device)
        vl, cl = torch.randint(1, 5, (7,), generator=gen), torch.randint(0, 4, (7,), generator=gen)
        z = live.confidence_logits(x)
        assert torch.equal(replay.predict(draft_features(x)), z)
        live.observe(verify_lens=vl, correct_lens=cl)
        replay.observe(verify_lens=vl, correct_lens=cl, features=draft_features(x))
    assert torch.equal(live.parameters, replay.parameters) and live.refits == 3
    with pytest.raises(ValueError, match=r"features must be \[B, 3, 3\] \(draft_features\), got \(7, 3\)"):
        replay.predict(torch.zeros(7, 3))
    with pytest.raises(ValueError, match=r"features must be \[B, 3, 3\].*got \(7, 2, 3\)"):
        replay.observe(verify_lens=vl, correct_lens=cl, features=torch.zeros(7, 2, 3))


def test_features_of_scattered_logits_equal_the_draft_vocabulary_ones(device):
    """The engine feeds the draft-vocabulary logits; scattered into a larger vocabulary with -inf elsewhere
    (what the verify sees) they give the same features."""
    reduced = _logits(3, 2, 40, 9, masked=0.0)
    ids = torch.randperm(500, generator=torch.Generator().manual_seed(3))[:40]
    full = torch.full((3, 2, 500), -math.inf).index_copy_(-1, ids, reduced)
    torch.testing.assert_close(draft_features(full.to(device)).cpu(), draft_features(reduced.to(device)).cpu(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_features_and_logits_compile_without_graph_breaks(backend, device):
    """The estimator's device-side work (features, then the per-position model) under
    torch.compile(fullgraph=True, dynamic=True) equals eager bit for bit (DESIGN.md 3)."""
    torch._dynamo.reset()
    est = _trained_estimator(3, 4)
    fn = torch.compile(lambda x: est.predict(draft_features(x)), fullgraph=True, dynamic=True, backend=backend)
    for b, v in ((2, 37), (5, 64)):
        x = _logits(b, 3, v, b * v).to(device)
        assert torch.equal(fn(x), est.predict(draft_features(x)))
