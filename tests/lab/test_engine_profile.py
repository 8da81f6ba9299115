import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.cost import AdditiveCostModel, ProfileSample, StepsPerSecondTable
from dspark.lab.profile import fit_cost_model
from dspark.serve.config import EngineConfig

SAMPLES = [ProfileSample(b, m, 1e-3 * (1.0 + 0.5 * b + 0.25 * m)) for b in (1, 4, 16) for m in range(b, 8 * b + 1, b)]


def test_fit_cost_model_takes_the_finest_valid_additive_fit():
    model, report, row_bin = fit_cost_model(SAMPLES, gamma=7, platform="cpu")
    assert isinstance(model, AdditiveCostModel) and row_bin == 1
    assert report.rms < 1e-6


def test_fit_cost_model_falls_back_to_the_steps_table_with_a_warning(monkeypatch, caplog):
    def refuse(cls, samples, **kwargs):
        raise ValueError(f"predicts a non-positive step time at row_bin={kwargs.get('row_bin')}")

    monkeypatch.setattr(AdditiveCostModel, "fit", classmethod(refuse))
    with caplog.at_level(logging.WARNING):
        model, _, row_bin = fit_cost_model(SAMPLES, gamma=7, platform="cpu")
    assert isinstance(model, StepsPerSecondTable) and row_bin is None and model.width == 8
    assert "falling back to the 1-D steps/s table" in caplog.text and "row_bin=64" in caplog.text
    t = model.step_seconds(4, 20)
    assert math.isfinite(t) and t > 0
    assert model.step_seconds(16, 128) == pytest.approx(1e-3 * (1.0 + 0.5 * 16 + 0.25 * 128))


def test_monotone_in_rows_pools_dips_per_batch_size():
    from dspark.lab.profile import monotone_in_rows

    raw = [ProfileSample(1, 1, 5.0), ProfileSample(1, 2, 3.0), ProfileSample(1, 3, 4.0), ProfileSample(1, 4, 9.0),
           ProfileSample(4, 4, 2.0), ProfileSample(4, 8, 1.0)]
    out = {(s.num_requests, s.rows): s.seconds for s in monotone_in_rows(raw)}
    assert out == {(1, 1): 4.0, (1, 2): 4.0, (1, 3): 4.0, (1, 4): 9.0, (4, 4): 1.5, (4, 8): 1.5}
    gen = torch.Generator().manual_seed(0)
    noisy = [ProfileSample(b, m, float(m + 3 * torch.rand((), generator=gen))) for b in (2, 5) for m in range(b, 30)]
    fixed = monotone_in_rows(noisy)
    for b in (2, 5):
        vals = [s.seconds for s in sorted((s for s in fixed if s.num_requests == b), key=lambda s: s.rows)]
        assert all(x <= y for x, y in zip(vals, vals[1:]))  # non-decreasing in the rows
        assert sum(vals) == pytest.approx(sum(s.seconds for s in noisy if s.num_requests == b))  # pooling keeps sums
    assert monotone_in_rows(fixed) == fixed  # already monotone: unchanged


@settings(max_examples=40)
@given(batch_sizes=st.lists(st.integers(1, 80), min_size=1, max_size=4, unique=True), width=st.integers(1, 9))
def test_tier_ladder_covers_every_step_a_profile_can_measure(batch_sizes, width):
    from dspark.verify.layout import tier_ladder

    tiers = tier_ladder(batch_sizes, width)
    lo, top = min(batch_sizes), max(batch_sizes) * width
    assert list(tiers) == sorted(set(tiers)) and tiers[0] == lo and tiers[-1] == top
    assert {b for b in batch_sizes} | {b * width for b in batch_sizes} <= set(tiers)  # plain and static unpadded
    # every step a profiled B can run pads to a tier at most 1.5x its rows (+1)
    for b in batch_sizes:
        for m in range(b, b * width + 1):
            assert min(t for t in tiers if t >= m) <= max(m * 3 // 2, m + 1)
    # every tier is the top of some step a profile at these batch sizes runs (in [B, B*W] of some B)
    assert all(any(b <= t <= b * width for b in batch_sizes) for t in tiers)


def test_tiered_profile_measures_each_tier_top_and_fits_the_measured_table():
    from dspark.cost import TieredCostModel
    from dspark.lab.profile import profile_points

    tiers = (1, 2, 3, 4, 5, 8, 12, 16, 20)
    grid = profile_points((1, 4), 4, tiers)
    assert grid == [(1, m) for m in (1, 2, 3, 4, 5)] + [(4, m) for m in (4, 5, 8, 12, 16, 20)]
    # a CPU's cost that dips at 16 rows (not additive) and a noise-sized dip at 5: tier 12 (16 rows ran 9 %
    # faster at B = 4) is left out and its samples with it, then the measured cells are pooled monotone
    secs = {1: 0.10, 2: 0.10, 3: 0.11, 4: 0.14, 5: 0.135, 8: 0.17, 12: 0.21, 16: 0.19, 20: 0.20}
    samples = [ProfileSample(b, m, secs[m] + (0.01 if b == 4 else 0.0)) for b, m in grid]
    model, _, _ = fit_cost_model(samples, gamma=4, platform="cpu", tiers=tiers)
    assert isinstance(model, TieredCostModel) and model.tiers == (1, 2, 3, 4, 5, 8, 16, 20)
    assert model.step_seconds(1, 3) == pytest.approx(0.11) and model.step_seconds(4, 8) == pytest.approx(0.18)
    assert model.step_seconds(1, 4) == pytest.approx(0.1375) == model.step_seconds(1, 5)  # within the margin
    assert model.step_seconds(4, 9) == pytest.approx(0.20) == model.step_seconds(4, 16)  # 9-16 rows: tier 16
    assert model.step_seconds(4, 20) == pytest.approx(0.21)


def test_profile_catch_up_recovers_the_seconds_per_caught_up_token(monkeypatch, device):
    """A drafter whose proposal costs 40 ms + 3 ms per token caught up beyond the roots, on a clock only the
    drafter advances: the profiled slope is 3 ms, whatever the accepted lengths (the first step catches up the
    prompts, the later ones what the step before committed beyond one)."""
    from dspark.lab.profile import ProfileRuns
    from dspark.lab.serving_profile import profile_catch_up
    from dspark.serve.drafters.block import BlockDrafter
    from dspark.serve.engine import SpecDecoder
    from tests.engine_models import VOCAB, tiny_models

    clock = [0.0]
    propose = BlockDrafter.propose

    def timed(self, batch, slots, k, source, sampling):
        drafts = propose(self, batch, slots, k, source, sampling)
        clock[0] += 0.040 + 0.003 * drafts.catch_up
        return drafts

    monkeypatch.setattr(BlockDrafter, "propose", timed)
    target, draft = tiny_models(gamma=3)
    dec = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=1024, device=device))
    monkeypatch.setattr(dec, "_now", lambda: clock[0])
    prompts = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(2))
    assert profile_catch_up(dec, prompts.to(device), 3, runs=ProfileRuns(tokens=8, repeats=2)) == pytest.approx(
        0.003, rel=1e-6)


@pytest.mark.cpu_only(reason="which attention path serves a CPU tensor")
def test_a_profile_names_how_its_attention_reads_the_kv_cache(monkeypatch):
    """dspark's CPU torch attention pads every request to the longest; the Triton kernel walks each request's own
    length (forced here through the backend switch, under the interpreter)."""
    from dspark.kernels import dispatch
    from dspark.lab.serving_profile import attention_kv_layout

    monkeypatch.setenv(dispatch.BACKEND_ENV, "auto")
    assert attention_kv_layout(torch.device("cpu")) == "padded"
    if dispatch._triton.available():
        monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
        assert attention_kv_layout(torch.device("cpu")) == "ragged"


@pytest.mark.cpu_only(reason="fits a table from synthetic samples")
def test_a_draft_phase_longer_than_a_step_never_prices_the_target_at_or_below_zero():
    """The draft phase is timed in other runs than the whole steps: under load its median can exceed a step's
    cheapest cell. The part taken out is then held to half that cell, and the file says where."""
    from dspark.cost.serving import BatchCurve, PrefillCost
    from dspark.cost.shipped import ServingCostSpec
    from dspark.lab.profile import profile_points
    from dspark.lab.serving_profile import ServingProfile, profiled_cost

    tiers = (1, 2, 3, 4, 8, 12, 16)
    grid = profile_points((1, 4), 3, tiers)
    samples = [ProfileSample(b, m, 1e-3 * (2 + 0.1 * m)) for b, m in grid]
    plain = BatchCurve((1, 4), (1.5e-3, 2e-3))
    drafting = [BatchCurve((1, 4), (1e-3 * k, 5e-3 * k)) for k in (1, 2, 3)]  # 15 ms at B = 4: over every cell
    cost = profiled_cost(ServingProfile(samples, plain, drafting, PrefillCost(0.0, 1e-5)),
                         ServingCostSpec("noisy", "", gamma=3, max_requests=4, tiers=tiers))
    for b in (1, 4):
        cells = [float(cost.verify.step_seconds(b, m)) for m in range(b, 4 * b + 1)]
        assert min(cells) > 0, (b, cells)
    assert any("held to half the cheapest cell at B = [1, 4]" in s for s in cost.sources), cost.sources


@pytest.mark.cpu_only(reason="fits a table from synthetic samples")
def test_a_kv_slope_larger_than_the_plain_steps_never_prices_plain_at_or_below_zero():
    """The KV slope comes from other runs than the plain steps (CI's device_check dry run met a slope whose
    context share exceeded the plain step under load): it is held so that the share is at most half of every
    plain step, and the file says so; a plausible slope is kept as measured."""
    from dspark.cost.serving import BatchCurve, PrefillCost
    from dspark.cost.shipped import ServingCostSpec
    from dspark.lab.profile import profile_points
    from dspark.lab.serving_profile import ServingProfile, profiled_cost

    tiers = (1, 2, 3, 4, 8, 12, 16)
    grid = profile_points((1, 4), 3, tiers)
    samples = [ProfileSample(b, m, 1e-3 * (2 + 0.1 * m)) for b, m in grid]
    plain = BatchCurve((1, 4), (1.5e-3, 2e-3))
    drafting = [BatchCurve((1, 4), (1e-4 * k, 2e-4 * k)) for k in (1, 2, 3)]

    def fit(per_kv: float):
        return profiled_cost(ServingProfile(samples, plain, drafting, PrefillCost(0.0, 1e-5), kv=(per_kv, 10.0)),
                             ServingCostSpec("noisy", "", gamma=3, max_requests=4, tiers=tiers))

    noisy = fit(1e-3)  # 10 tokens x 1 ms: 10 ms of context per request, over every plain step
    assert noisy.per_kv_token == pytest.approx(0.5 * 2e-3 / (10.0 * 4))  # half of B = 4's plain step per token
    assert all(noisy.plain_seconds(b) > 0 for b in (1, 2, 3, 4))
    assert any("KV slope held" in s for s in noisy.sources), noisy.sources
    calm = fit(1e-6)
    assert calm.per_kv_token == 1e-6 and not any("KV slope held" in s for s in calm.sources)


@pytest.mark.cpu_only(reason="builds planners from a synthetic profile")
def test_profiled_planners_price_each_depth_by_its_own_draft_on_the_decoders_tiers():
    """Depth gamma plans with the whole-step table, a shallower depth with the serving cost's target part plus
    that depth's draft; the tiers and graph slots are the served decoder's, the temperatures cut to the depth."""
    import types

    from dspark.cost.serving import BatchCurve, PrefillCost
    from dspark.cost.shipped import ServingCostSpec
    from dspark.lab.profile import ProfileRuns, profile_points
    from dspark.lab.serving_profile import ProfiledPlanners, ServingProfile, profiled_cost, serving_cost_of_steps
    from dspark.plan.planner import PlannerSettings

    tiers = (1, 2, 3, 4, 8, 12, 16)
    samples = [ProfileSample(b, m, 1e-3 * (20 + 0.5 * m)) for b, m in profile_points((1, 4), 3, tiers)]
    table = fit_cost_model(samples, gamma=3, platform="cpu", tiers=tiers)[0]
    drafting = [BatchCurve((1, 4), (1e-3 * k, 2e-3 * k)) for k in (1, 2, 3)]
    serving = profiled_cost(ServingProfile(samples, BatchCurve((1, 4), (15e-3, 18e-3)), drafting,
                                           PrefillCost(0.0, 1e-5)),
                            ServingCostSpec("synthetic", "", gamma=3, max_requests=4, tiers=tiers))
    served = types.SimpleNamespace(tiers=(1, 2, 4, 8, 16), graph_slots=lambda b, w: 10 * b + w)
    planners = ProfiledPlanners(table, serving, served, [1.5, 1.25, 0.75],
                                PlannerSettings(lag=0, num_slots=8, live_argmax=True))
    deep, shallow = planners(4), planners(4, True, 1)
    assert deep.cost_model is table and deep.cfg.gamma == 3 and shallow.cfg.gamma == 1
    believed = serving.believed(1, 0.0)
    assert [float(shallow.cost_model.step_seconds(4, m)) for m in range(4, 9)] == pytest.approx(
        [float(believed.step_seconds(4, m)) for m in range(4, 9)])
    assert float(believed.step_seconds(4, 8)) < float(table.step_seconds(4, 8))  # one draft, not three
    assert deep.temperatures.tolist() == [1.5, 1.25, 0.75] and shallow.temperatures.tolist() == [1.5]
    assert planners(4, False).temperatures is None
    assert deep.tiers == (1, 2, 4, 8, 16) and deep.graph_slots == 44 and shallow.graph_slots == 42
    assert deep.settings.live_argmax and deep.lag == 0
    with pytest.raises(ValueError, match=r"batch_sizes must start at 1 \(the cost covers"):
        serving_cost_of_steps(served, None, (samples, None), (4,), ServingCostSpec("x", "", gamma=3, max_requests=4,
                                                                                   tiers=tiers), runs=ProfileRuns(4, 1))
