import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dspark import SurvivalLagRing, calibrated_survival, monotone_survival
from dspark.plan.survival import _survival, check_temperatures, monotone_host


def test_teaching_example_survival(device):
    c = torch.tensor([[0.9, 0.8], [0.6, 0.5]], dtype=torch.float64)
    s = calibrated_survival(torch.logit(c).float().to(device))
    torch.testing.assert_close(s, torch.tensor([[0.9, 0.72], [0.6, 0.3]], device=device), rtol=1e-6, atol=1e-6)
    assert s.dtype == torch.float32


@given(b=st.integers(0, 9), g=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_matches_float64_reference_and_is_monotone(b, g, seed, device):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(b, g, generator=gen, dtype=torch.float64) * 3
    temps = torch.rand(g, generator=gen, dtype=torch.float64) * 2 + 0.2
    s = calibrated_survival(z.to(device), temperatures=temps)
    ref = torch.cumprod(torch.sigmoid(z / temps), dim=1)
    torch.testing.assert_close(s.cpu().double(), ref, rtol=1e-5, atol=1e-6)
    if g > 1:
        assert bool((s[:, 1:] <= s[:, :-1]).all())


SPECIAL = [3e38, -3e38, 1e-30, math.inf, -math.inf, math.nan]


@st.composite
def batch_with_probe(draw):
    """A batch of random logits [n + 1, gamma] with some special values, and the position of the request
    under test in it (its own row is the same whatever the batch around it)."""
    g, n, seed = draw(st.integers(1, 9)), draw(st.integers(0, 40)), draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    batch = torch.randn(n + 1, g, generator=gen) * draw(st.sampled_from([0.5, 3.0, 30.0]))
    for r, k, v in draw(st.lists(st.tuples(st.integers(0, n), st.integers(0, g - 1), st.sampled_from(SPECIAL)),
                                 max_size=4)):
        batch[r, k] = v
    return batch, draw(st.integers(0, n))


@given(case=batch_with_probe(), tempered=st.booleans())
def test_a_requests_survival_bits_do_not_depend_on_its_batch(case, tempered, device):
    """Alone, or at any position of a batch of any size, on the host path, the torch path (autograd) and
    the device under test: the same float32 bits for the same request."""
    batch, at = case
    temps = [0.5 + 0.25 * k for k in range(batch.shape[1])] if tempered else None
    alone = calibrated_survival(batch[at: at + 1].clone(), temps)
    for z in (batch, batch.clone().requires_grad_(), batch.to(device)):
        got = calibrated_survival(z, temps)[at: at + 1].detach().cpu()
        assert torch.equal(got, alone), (z.device, z.requires_grad, got, alone)


def test_a_finite_logit_whose_ratio_overflows_keeps_its_confidence(device):
    for z in (torch.tensor([[3e38, -3e38]]), torch.tensor([[1e300, -1e300]], dtype=torch.float64)):
        c = _survival(z.to(device)[:, :1], check_temperatures([0.5], 1))
        assert c.item() == 1.0
        assert _survival(z.to(device)[:, 1:], check_temperatures([0.5], 1)).item() == 0.0
    assert calibrated_survival(torch.tensor([[3e38, 3e38]], device=device), [0.5, 0.25]).tolist() == [[1.0, 1.0]]


def test_non_finite_logits_give_zero_confidence(device):
    z = torch.tensor([[2.0, math.nan, 1.0], [math.inf, 0.0, 0.0], [0.0, 0.0, -math.inf]], device=device)
    s = calibrated_survival(z).cpu()
    assert s[0, 0] > 0 and bool((s[0, 1:] == 0).all())
    assert bool((s[1] == 0).all())
    assert s[2, 1] == pytest.approx(0.25) and s[2, 2] == 0


@given(b=st.integers(1, 9), g=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_fixed_order_float32_product_and_unchecked_path(b, g, seed, device):
    """Bit for bit: divide and sigmoid in float64, one rounding to float32, then a left-to-right float32
    product (no double accumulation, no scan); the planner's pre-validated paths (torch, numpy) give the same bits."""
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(b, g, generator=gen) * 4).to(device)
    z[0, -1] = math.inf
    temps = check_temperatures((torch.rand(g, generator=gen) * 2 + 0.2).tolist(), g)
    s = calibrated_survival(z, temps)
    c = torch.where(torch.isfinite(z), 1 / (1 + torch.exp(-z.double() / temps.to(device).double())), 0.0).float()
    want = c.clone()
    for k in range(1, g):
        want[:, k] = want[:, k - 1] * c[:, k]
    assert torch.equal(s, want)
    assert torch.equal(_survival(z, temps), s)
    # the planner's numpy host path and the torch path on tensors that require grad give the same bits
    assert torch.equal(_survival(z.cpu(), temps, host=True), s.cpu())
    assert torch.equal(calibrated_survival(z.clone().requires_grad_(), temps).detach(), s)


@pytest.mark.parametrize(
    "temps, needle",
    [([1.0, 2.0], "length gamma=3"), ([1.0, 0.0, 1.0], "temperatures[1] = 0.0"),
     ([1.0, 1.0, math.nan], "temperatures[2] = nan"), ([-1.0, 1.0, 1.0], "temperatures[0] = -1.0")],
)
def test_bad_temperatures(temps, needle, device):
    with pytest.raises(ValueError) as info:
        calibrated_survival(torch.zeros(2, 3, device=device) + 0.5, temperatures=temps)
    assert needle in str(info.value)


def test_bad_logits(device):
    with pytest.raises(ValueError, match=r"2-D"):
        calibrated_survival(torch.zeros(3, device=device))
    with pytest.raises(TypeError, match="floating"):
        calibrated_survival(torch.zeros(2, 3, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="torch.Tensor"):
        calibrated_survival([[0.1]])


def test_monotone_survival_running_min_and_nan(device):
    s = torch.tensor([[0.9, 0.95, 0.5, math.nan, 0.4]], device=device)
    out = monotone_survival(s)
    assert out.device == s.device
    assert out.tolist() == [[pytest.approx(0.9), pytest.approx(0.9), 0.5, 0.0, 0.0]]


@pytest.mark.cpu_only(reason="the host (numpy) repair")
@given(b=st.integers(0, 9), g=st.integers(1, 7), seed=st.integers(0, 2**31 - 1), nan=st.booleans(),
       calibrated=st.booleans())
def test_host_repair_equals_monotone_survival(b, g, seed, nan, calibrated):
    """The host repair returns the array itself when nothing needs repair, else monotone_survival's bits."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(b, g, generator=gen) * 3
    s = calibrated_survival(z) if calibrated else torch.rand(b, g, generator=gen)
    if nan and b:
        s[int(torch.randint(0, b, (1,), generator=gen)), int(torch.randint(0, g, (1,), generator=gen))] = math.nan
    values = s.numpy()
    got = monotone_host(values)
    assert torch.equal(torch.from_numpy(got), monotone_survival(s))
    already = not bool(s.isnan().any()) and (g == 1 or bool((s[:, 1:] <= s[:, :-1]).all()))
    assert (got is values) == already
    assert already or not (calibrated and not nan)  # calibrated survival needs no repair


def test_lag_ring_generation_guard(device):
    ring = SurvivalLagRing(num_slots=4, gamma=2, lag=1, device=device)
    t = lambda x: torch.tensor(x, device=device)  # noqa: E731
    slots, gens = t([0, 2]), t([5, 1])
    s1 = t([[0.5, 0.25], [0.3, 0.1]])
    lagged = ring.exchange(slots, gens, s1)
    assert torch.equal(lagged, torch.ones(2, 2, device=device))  # never written: optimistic
    s2 = t([[0.7, 0.6], [0.2, 0.2]])
    lagged = ring.exchange(slots, t([5, 2]), s2)  # slot 2 reused by a new request
    assert torch.equal(lagged[0], s1[0]) and torch.equal(lagged[1], torch.ones(2, device=device))
    lagged = ring.read(t([2]), t([2]))
    assert torch.equal(lagged[0], s2[1])


def test_lag_ring_depth_two(device):
    ring = SurvivalLagRing(num_slots=1, gamma=1, lag=2, device=device)
    slot, gen = torch.tensor([0], device=device), torch.tensor([0], device=device)
    outs = [ring.exchange(slot, gen, torch.tensor([[v]], device=device)).item() for v in (0.1, 0.2, 0.3, 0.4)]
    assert outs == [1.0, 1.0, pytest.approx(0.1), pytest.approx(0.2)]


def test_lag_ring_bad_input(device):
    ring = SurvivalLagRing(num_slots=2, gamma=2, device=device)
    with pytest.raises(ValueError, match="slots must lie in"):
        ring.read(torch.tensor([2], device=device), torch.tensor([0], device=device))
    with pytest.raises(ValueError, match=r"\[1, 2\]"):
        ring.write(torch.tensor([0], device=device), torch.tensor([0], device=device), torch.zeros(1, 3, device=device))
    with pytest.raises(ValueError, match="lag must be"):
        SurvivalLagRing(num_slots=2, gamma=2, lag=0)
