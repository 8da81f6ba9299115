import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark import (
    ScheduleConfig,
    allocate_verify_lens,
    calibrated_survival,
    expected_commit,
)
from dspark.kernels import dispatch, topk

# Survival on a coarse dyadic grid: many exact ties, and sums are exact in float32 and float64.
GRID = [0.0, 0.125, 0.25, 0.5, 0.75, 1.0]


@st.composite
def cases(draw, max_b=4, max_gamma=4):
    gamma = draw(st.integers(1, max_gamma))
    b = draw(st.integers(0, max_b))
    lo = draw(st.integers(0, gamma + 1))
    hi = draw(st.one_of(st.none(), st.integers(max(lo, 1), gamma + 1)))
    eps = draw(st.sampled_from([0.0, 1e-6, 0.2, 0.6]))
    cfg = ScheduleConfig(gamma=gamma, min_verify_len=lo, max_verify_len=hi, survival_eps=eps)
    s = torch.tensor(draw(st.lists(st.lists(st.sampled_from(GRID), min_size=gamma, max_size=gamma),
                                   min_size=b, max_size=b)), dtype=torch.float32).reshape(b, gamma)
    s = torch.sort(s, dim=1, descending=True).values
    budget = draw(st.integers(0, b * gamma + 2))
    return cfg, s, budget


def global_order_lens(s: torch.Tensor, budget: int, cfg: ScheduleConfig) -> list[int]:
    """The spec, literally: sort valid candidates by (survival desc, position asc, request asc)."""
    b = s.shape[0]
    cands = [(-float(s[r, j]), j, r) for r in range(b) for j in range(cfg.floor - 1, cfg.cap - 1)
             if float(s[r, j]) >= cfg.survival_eps]
    lens = [cfg.floor] * b
    for _, _, r in sorted(cands)[:budget]:
        lens[r] += 1
    return lens


def brute_force_best(s: torch.Tensor, budget: int, cfg: ScheduleConfig) -> float:
    """max expected commit over every allocation in [F, M_max]^B that verifies only valid candidates."""
    b = s.shape[0]
    best = -math.inf
    for lens in itertools.product(range(cfg.floor, cfg.cap + 1), repeat=b):
        if sum(v - cfg.floor for v in lens) > budget:
            continue
        if any(float(s[r, j]) < cfg.survival_eps for r in range(b) for j in range(cfg.floor - 1, lens[r] - 1)):
            continue
        best = max(best, sum(1 + sum(float(s[r, j]) for j in range(lens[r] - 1)) for r in range(b)))
    return best


def test_teaching_example(device):
    cfg = ScheduleConfig(gamma=2)
    s = calibrated_survival(torch.logit(torch.tensor([[0.9, 0.8], [0.6, 0.5]], dtype=torch.float64)).to(device))
    vl = allocate_verify_lens(s, 2, cfg)
    assert vl.tolist() == [3, 1] and vl.dtype == torch.int32 and vl.device.type == device.type
    assert expected_commit(s, vl, cfg) == pytest.approx(3.62, abs=1e-6)


@settings(max_examples=60)
@given(case=cases())
def test_allocation_is_optimal_and_follows_the_global_order(case, device):
    cfg, s, budget = case
    vl = allocate_verify_lens(s.to(device), budget, cfg).cpu()
    assert vl.tolist() == global_order_lens(s, budget, cfg)
    extra = vl - cfg.floor
    assert bool((vl >= cfg.floor).all()) and bool((vl <= cfg.cap).all())
    assert int(extra.sum()) <= budget
    assert expected_commit(s, vl, cfg) == pytest.approx(brute_force_best(s, budget, cfg), abs=1e-9)


@given(case=cases(max_b=6, max_gamma=6))
def test_selection_is_a_prefix_of_valid_candidates(case, device):
    cfg, s, budget = case
    vl = allocate_verify_lens(s.to(device), budget, cfg).cpu()
    for r in range(s.shape[0]):
        taken = list(range(cfg.floor - 1, int(vl[r]) - 1))
        assert all(float(s[r, j]) >= cfg.survival_eps for j in taken)
    n_valid = int((s[:, cfg.floor - 1: cfg.cap - 1] >= cfg.survival_eps).sum())
    assert int((vl - cfg.floor).sum()) == min(budget, n_valid)


def test_ties_position_first_then_request(device):
    cfg = ScheduleConfig(gamma=2, survival_eps=0.0)
    s = torch.tensor([[0.5, 0.5], [0.5, 0.4], [0.5, 0.5]], device=device)
    got = [allocate_verify_lens(s, k, cfg).tolist() for k in range(7)]
    assert got == [[1, 1, 1], [2, 1, 1], [2, 2, 1], [2, 2, 2], [3, 2, 2], [3, 2, 3], [3, 3, 3]]


def test_survival_handed_in_is_made_monotone(device):
    cfg = ScheduleConfig(gamma=3)
    s = torch.tensor([[0.2, 0.9, math.nan], [0.5, 0.45, 0.4]], device=device)
    assert allocate_verify_lens(s, 3, cfg).tolist() == [1, 4]
    assert allocate_verify_lens(s, 4, cfg).tolist() == [2, 4]
    assert allocate_verify_lens(s, 6, cfg).tolist() == [3, 4]


def test_edge_budgets_and_batches(device):
    cfg = ScheduleConfig(gamma=3, min_verify_len=2)
    s = torch.tensor([[0.9, 0.8, 0.7], [0.6, 0.5, 1e-9]], device=device)
    assert allocate_verify_lens(s, 0, cfg).tolist() == [2, 2]
    assert allocate_verify_lens(s, 10**9, cfg).tolist() == [4, 3]
    empty = allocate_verify_lens(torch.zeros(0, 3, device=device), 5, cfg)
    assert empty.shape == (0,) and empty.dtype == torch.int32
    assert allocate_verify_lens(s[:1], 1, cfg).tolist() == [3]


def test_nan_and_inf_logits_are_never_verified(device):
    cfg = ScheduleConfig(gamma=3)
    z = torch.tensor([[4.0, math.nan, 4.0], [math.inf, 4.0, 4.0], [-math.inf, 4.0, 4.0], [4.0, 4.0, 4.0]])
    vl = allocate_verify_lens(calibrated_survival(z.to(device)), 100, cfg)
    assert vl.tolist() == [2, 1, 1, 4]


@pytest.mark.parametrize("budget, exc, needle", [
    (-1, ValueError, "-1"), (1.5, TypeError, "1.5"), (True, TypeError, "True"), ("3", TypeError, "'3'"),
])
def test_bad_budget(budget, exc, needle, device):
    with pytest.raises(exc, match=needle):
        allocate_verify_lens(torch.full((2, 3), 0.5, device=device), budget, ScheduleConfig(gamma=3))


def test_bad_survival_and_config(device):
    cfg = ScheduleConfig(gamma=3)
    with pytest.raises(ValueError, match=r"gamma=3.*\(2, 4\)"):
        allocate_verify_lens(torch.zeros(2, 4, device=device), 1, cfg)
    with pytest.raises(TypeError, match="ScheduleConfig"):
        allocate_verify_lens(torch.zeros(2, 3, device=device), 1, {"gamma": 3})
    with pytest.raises(TypeError, match="torch.Tensor"):
        allocate_verify_lens([[0.5, 0.5, 0.5]], 1, cfg)


def _kernel_matches_reference(s, budget, cfg, policy):
    poison = torch.full((s.shape[0],), -7, dtype=torch.int32, device=s.device)
    with dispatch.launch_policy(*policy):
        got = topk.verify_lens_triton(s, budget, cfg.floor, cfg.cap, cfg.survival_eps, out=poison)
    want = topk.verify_lens_ref(s, budget, cfg.floor, cfg.cap, cfg.survival_eps)
    assert torch.equal(got.cpu(), want.cpu()), (s, budget, cfg, got, want)


@settings(max_examples=12)
@given(case=cases(max_b=7, max_gamma=6), policy=st.sampled_from([("work", None), ("cores", 3)]))
def test_triton_kernel_equals_reference_on_ties(case, policy, device):
    cfg, s, budget = case
    _kernel_matches_reference(s.to(device), budget, cfg, policy)


@settings(max_examples=10)
@given(b=st.integers(1, 9), gamma=st.integers(1, 8), seed=st.integers(0, 2**31 - 1),
       policy=st.sampled_from([("work", None), ("cores", 3)]))
def test_triton_kernel_equals_reference_on_random_logits(b, gamma, seed, policy, device):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(b, gamma, generator=gen) * 3
    z[torch.rand(b, gamma, generator=gen) < 0.1] = math.nan
    s = calibrated_survival(z.to(device))
    budget = int(torch.randint(0, b * gamma + 2, (), generator=gen))
    _kernel_matches_reference(s, budget, ScheduleConfig(gamma=gamma), policy)


def test_dispatch_runs_the_kernel_when_forced(triton_backend, device):
    cfg = ScheduleConfig(gamma=2)
    s = torch.tensor([[0.9, 0.72], [0.6, 0.3]], device=device)
    for policy in (("work", None), ("cores", 3)):
        with dispatch.launch_policy(*policy):
            assert allocate_verify_lens(s, 2, cfg).tolist() == [3, 1]
            assert allocate_verify_lens(torch.zeros(0, 2, device=device), 2, cfg).shape == (0,)


@settings(max_examples=40)
@given(case=cases(max_b=7, max_gamma=6))
def test_host_path_and_torch_reference_agree_with_the_global_order(case, device):
    cfg, s, budget = case
    args = (budget, cfg.floor, cfg.cap, cfg.survival_eps)
    want = global_order_lens(s, budget, cfg)
    assert topk.verify_lens_ref(s.to(device), *args).tolist() == want
    assert topk.verify_lens_host(s.numpy(), *args).tolist() == want
    ranked = np.sort(s.numpy()[:, cfg.floor - 1: cfg.cap - 1], axis=None)  # the budget scan's sorted window
    assert topk.verify_lens_host(s.numpy(), *args, ranked=ranked).tolist() == want


def test_forced_torch_backend_uses_the_reference(torch_backend, device):
    cfg = ScheduleConfig(gamma=2, survival_eps=0.0)
    s = torch.tensor([[0.5, 0.5], [0.5, 0.4], [0.5, 0.5]], device=device)
    assert not dispatch.use_host(s)
    assert allocate_verify_lens(s, 4, cfg).tolist() == [3, 2, 2]


def test_negative_zero_counts_as_zero(device):
    cfg = ScheduleConfig(gamma=2, survival_eps=0.0)
    s = torch.tensor([[-0.0, -0.0], [0.25, 0.0]], device=device)
    assert allocate_verify_lens(s, 3, cfg).tolist() == [3, 2]
    for fn in (topk.verify_lens_ref, lambda *a: topk.verify_lens_host(a[0].cpu().numpy(), *a[1:])):
        assert fn(s, 3, 1, 3, 0.0).tolist() == [3, 2]


def test_negative_zero_in_the_kernel(device):
    s = torch.tensor([[-0.0, -0.0], [0.25, 0.0]], device=device)
    out = torch.full((2,), -7, dtype=torch.int32, device=device)
    assert topk.verify_lens_triton(s, 3, 1, 3, 0.0, out=out).tolist() == [3, 2]


def test_triton_kernel_across_several_tiles(device):
    """n = B * C > 1024 candidates: the threshold search loops over more than one tile."""
    gen = torch.Generator().manual_seed(7)
    grid = torch.tensor(GRID[1:])
    s = grid[torch.randint(0, len(GRID) - 1, (170, 7), generator=gen)].sort(dim=1, descending=True).values
    cfg = ScheduleConfig(gamma=7, survival_eps=0.2)
    for budget in (333, 1100):
        _kernel_matches_reference(s.to(device), budget, cfg, ("cores", 3))


def test_triton_kernel_with_no_valid_candidate(device):
    cfg = ScheduleConfig(gamma=3, survival_eps=0.5)
    _kernel_matches_reference(torch.full((4, 3), 0.25, device=device), 5, cfg, ("work", None))
