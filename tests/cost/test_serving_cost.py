"""Serving cost models (schema version 2): the JSON format, the shipped files (their coverage, and the analytic
ones re-made bit for bit by their generators), the published H100 formula split into its verify / plain /
draft / KV / prefill terms, the H200 roofline's regimes and its SGLang calibration, `perturbed`, and the errors
a bad input (or a version-1 file) gets. Pricing a step from its parts: tests/cost/test_step_pricing.py.

Tests that read graphs/cost_models/cpu-measured.json carry `cpu_measured` in their id; run the rest with
`-k "not cpu_measured"` (not `-k "not cpu"`: that also matches the `cpu_only` mark of every test here)."""
from __future__ import annotations

import dataclasses
import functools
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.cost import BatchTerm, ProfileSample, TieredCostModel, TierTerm
from dspark.cost.roofline import LlamaGeometry
from dspark.cost.serving import (
    COST_MODELS_DIR,
    SCHEMA,
    BatchCurve,
    DraftCost,
    PrefillCost,
    ServingCost,
    StepWork,
    load_serving_cost,
    perturbed,
    serving_cost_names,
)
from dspark.cost.shifted import ShiftedCostModel
from dspark.cost.shipped import (
    ANALYTIC,
    H200,
    LLAMA31_8B,
    SMOLLM2_135M,
    SMOLLM2_DRAFT,
    doublings,
    fill_monotone,
    h100_llama8b_fitted,
    h200_roofline_llama8b,
    h200_roofline_smollm2,
)
from dspark.lab.cost_models import main

pytestmark = pytest.mark.cpu_only(reason="serving cost files and arithmetic (host numpy)")

SHIPPED = ("cpu-measured", "h100-llama8b-fitted", "h200-roofline-llama8b", "h200-roofline-smollm2")
SMALL = {"h100-llama8b-fitted": h100_llama8b_fitted, "h200-roofline-smollm2": h200_roofline_smollm2,
         "h200-roofline-llama8b": h200_roofline_llama8b}
MS, US = 1e-3, 1e-6


def _id(name: str) -> str:
    """Test ids with underscores, so `-k "not cpu_measured"` leaves out every test that reads the cpu file."""
    return name.replace("-", "_")


@functools.lru_cache(maxsize=None)
def _shipped(name: str) -> ServingCost:
    return load_serving_cost(name)  # frozen: one load per file per session


def _curves(cost: ServingCost):
    """(B, verify seconds of M = B .. B*W) for every covered B."""
    for b in range(1, cost.max_requests + 1):
        yield b, cost.verify.seconds_curve(b, b, b * (cost.width - 1) + 1)


def test_the_shipped_names_are_the_four_files() -> None:
    assert serving_cost_names() == list(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED, ids=_id)
def test_every_shipped_file_loads_and_covers_every_b_m_and_depth(name: str) -> None:
    cost = load_serving_cost(name, width=4)
    assert cost.name == name and cost.max_requests == 256 and cost.width == 4
    assert cost.drafter.kind == "chain" and cost.drafter.max_drafts == 3 and cost.per_kv_token >= 0
    assert cost.prefill.per_token > 0
    for b, seconds in _curves(cost):
        assert np.isfinite(seconds).all() and (seconds > 0).all(), (name, b)
        assert (np.diff(seconds) >= 0).all(), (name, b, np.diff(seconds).min())
        assert cost.plain_seconds(b) > 0
        depths = [cost.draft_seconds(b, k) for k in (1, 2, 3)]
        assert depths[0] > 0 and depths == sorted(depths), (name, b, depths)  # a chain: deeper never cheaper


@pytest.mark.parametrize("name", sorted(ANALYTIC))
def test_the_analytic_files_are_their_generators_output_bit_for_bit(name: str, tmp_path) -> None:
    written = ANALYTIC[name]().save(tmp_path / f"{name}.json")
    assert written.read_bytes() == (COST_MODELS_DIR / f"{name}.json").read_bytes()
    assert main(["--write", name, "--out", str(tmp_path / "cli.json")]).read_bytes() == written.read_bytes()
    assert json.loads(written.read_text())["schema_version"] == 2


@given(data=st.data(), probes=st.sampled_from([(1, 2, 4), (1, 3, 8), (2, 5)]))
def test_fill_monotone_keeps_measured_cells_and_makes_every_b_non_decreasing_in_m(data, probes) -> None:
    w, tiers = 4, tuple(range(1, 4 * probes[-1] + 1))
    table, samples = [], []
    for b in probes:
        row = data.draw(st.lists(st.floats(0.01, 1.0), min_size=len(tiers), max_size=len(tiers)))
        measured = [i for i, t in enumerate(tiers) if b <= t <= b * w]
        row[measured[0]: measured[-1] + 1] = sorted(row[measured[0]: measured[-1] + 1])  # a PAV-fitted span
        table.append(row)
        samples += [ProfileSample(b, tiers[i], row[i]) for i in measured]
    model = TieredCostModel(0.0, BatchTerm(probes, [0.0] * len(probes)), TierTerm(tiers, [0.0] * len(tiers)),
                            table=table, width=w)
    filled = fill_monotone(model, samples)
    for s in samples:
        assert filled.table[probes.index(s.num_requests)][tiers.index(s.rows)] == s.seconds
    for b in range(probes[0], probes[-1] + 1):  # up to float rounding of the interpolation (one ulp of 1 s)
        assert (np.diff(filled.seconds_curve(b, b, b * (w - 1) + 1)) >= -1e-12).all()


def test_the_cpu_measured_file_is_the_demo_profile_of_the_shipped_models() -> None:
    cost = _shipped("cpu-measured")
    verify = cost.verify
    assert isinstance(verify, TieredCostModel) and verify.table is not None
    assert cost.platform.endswith("-cpu") and verify.platform == cost.platform
    assert cost.tiers == verify.tiers and cost.parameters["gamma"] == 3 and verify.width == 4
    if "long_prompt_len" in cost.parameters:  # profile_kv: plain steps on short and long prompts, slope >= 0
        assert cost.per_kv_token >= 0 and any(s.startswith("per KV token") for s in cost.sources)
    else:  # no KV profile: the profiled steps hold the profile's own contexts inside the table
        assert cost.per_kv_token == 0.0
    assert cost.prefill.per_token > 0 and cost.prefill.per_forward >= 0  # fit_prefill over measured admissions
    assert cost.prefill.seconds(100) > cost.prefill.seconds(10) > 0
    probes = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert cost.drafter.kind == "chain" and cost.drafter.max_drafts == 3
    assert cost.plain.batch_sizes == probes
    assert all(c.batch_sizes == probes for c in cost.drafter.seconds_per_depth)
    for b in probes:  # made non-decreasing in the depth; deeper drafts are measured as dearer at every probe
        assert 0 < cost.draft_seconds(b, 1) <= cost.draft_seconds(b, 2) <= cost.draft_seconds(b, 3)
    assert cost.draft_seconds(64, 3) > cost.draft_seconds(64, 1)
    step = verify.step_seconds
    for t in (64, 128, 256):  # past the profiled B = 64: B / 64 steps of 64 requests, same rows per request
        assert step(128, 2 * t) == pytest.approx(2 * step(64, t), rel=1e-12)
        assert step(256, 4 * t) == pytest.approx(4 * step(64, t), rel=1e-12)
    assert cost.plain_seconds(256) == pytest.approx(4 * cost.plain_seconds(64), rel=1e-12)
    for k in (1, 2, 3):
        assert cost.draft_seconds(256, k) == pytest.approx(4 * cost.draft_seconds(64, k), rel=1e-12)


@pytest.mark.parametrize(("start", "top", "out"), [(64, 256, [128, 256]), (64, 200, [128, 200]), (64, 64, []),
                                                   (1, 5, [2, 4, 5])])
def test_doublings(start: int, top: int, out: list) -> None:
    assert doublings(start, top) == out


@settings(max_examples=10)
@given(name=st.sampled_from(sorted(SMALL)), gamma=st.integers(1, 6), max_requests=st.integers(1, 24),
       context=st.integers(1, 2048))
def test_save_load_round_trip_is_equal(tmp_path_factory, name: str, gamma: int, max_requests: int,
                                       context: int) -> None:
    cost = SMALL[name](gamma=gamma, max_requests=max_requests)
    path = cost.save(tmp_path_factory.mktemp("rt") / "cost.json")
    again = load_serving_cost(path, width=gamma + 1)
    assert again == cost and again.to_dict() == cost.to_dict()
    assert again.drafter.kind == "chain" and again.drafter.max_drafts == gamma
    b = max_requests
    work = StepWork(b, b * (gamma + 1), kv_tokens=context * b, drafts=gamma, drafting=b, prefill_tokens=context)
    assert again.price(work) == cost.price(work) > cost.price(StepWork(b, b, kv_tokens=context * b))
    assert again.believed(gamma, context).step_seconds(b, b) == cost.believed(gamma, context).step_seconds(b, b)


def test_kv_layout_and_catch_up_round_trip_and_default_to_ragged_and_zero(tmp_path) -> None:
    cost = h100_llama8b_fitted(gamma=3, max_requests=8)
    cost = dataclasses.replace(cost, kv_layout="padded",
                               drafter=dataclasses.replace(cost.drafter, per_catch_up_token=3e-6))
    again = load_serving_cost(cost.save(tmp_path / "padded.json"), width=4)
    assert again == cost and again.kv_layout == "padded" and again.drafter.per_catch_up_token == 3e-6
    work = StepWork(4, 8, kv_tokens=100, drafts=1, drafting=4, catch_up=5, kv_longest=70)
    ragged = dataclasses.replace(again, kv_layout="ragged")
    assert again.price(work) - ragged.price(work) == pytest.approx(cost.per_kv_token * (4 * 70 - 100), rel=1e-12)
    assert again.price(work) - again.price(dataclasses.replace(work, catch_up=0)) == pytest.approx(15e-6, rel=1e-9)
    d = cost.to_dict()
    del d["kv_layout"], d["drafter"]["per_catch_up_token"]  # a file written before either existed
    (tmp_path / "old.json").write_text(json.dumps(d))
    old = load_serving_cost(tmp_path / "old.json", width=4)
    assert old.kv_layout == "ragged" and old.drafter.per_catch_up_token == 0.0


@settings(max_examples=10)
@given(name=st.sampled_from(sorted(SMALL)), gamma=st.integers(1, 6), max_requests=st.integers(1, 40))
def test_generators_cover_every_b_m_and_depth_non_decreasing(name: str, gamma: int, max_requests: int) -> None:
    cost = SMALL[name](gamma=gamma, max_requests=max_requests)
    assert cost.width == gamma + 1 and cost.drafter.max_drafts == gamma
    for b, seconds in _curves(cost):
        assert (seconds > 0).all() and (np.diff(seconds) >= 0).all()
        depths = [cost.draft_seconds(b, k) for k in range(1, gamma + 1)]
        assert all(d < e for d, e in zip(depths, depths[1:])), (b, depths)  # each generator's chain: dearer per k


@pytest.mark.parametrize("gen", [h100_llama8b_fitted, h200_roofline_llama8b])
def test_gamma_7_covers_b_256_up_to_m_2048(gen) -> None:
    cost = gen(gamma=7)
    assert cost.width == 8 and cost.drafter.max_drafts == 7 and math.isfinite(cost.verify.step_seconds(256, 2048))
    assert cost.draft_seconds(256, 7) > cost.draft_seconds(256, 6)


# H100 fit: verify T(B, M) = 5.89 ms + 1.2 ms + 21.0 us x tier(M) + 0.039 us x M (the M rows' own KV): no B term
@pytest.mark.parametrize(("b", "m", "ms"), [
    (1, 1, 7.09 + 0.021 + 0.000039),                # 7.111039
    (1, 4, 7.09 + 0.084 + 0.000156),                # 7.174156
    (4, 4, 7.09 + 0.084 + 0.000156),                # the same rows, more requests: the same seconds
    (3, 9, 7.09 + 0.336 + 0.000351),                # padded to tier 16: 7.426351
    (16, 64, 7.09 + 1.344 + 0.002496),              # 8.436496 (graphs/cost_models/README.md)
    (100, 257, 7.09 + 5.712 + 0.010023),            # padded to tier 272: 12.812023
    (130, 520, 7.09 + 10.92 + 0.02028),             # past 512, eager: 18.03028
    (256, 1024, 7.09 + 21.504 + 0.039936),          # 28.633936 (graphs/cost_models/README.md)
])
def test_h100_verify_is_the_published_target_term(b: int, m: int, ms: float) -> None:
    cost = load_serving_cost("h100-llama8b-fitted", width=4)
    assert cost.verify.step_seconds(b, m) == pytest.approx(ms * MS, rel=1e-12)


@pytest.mark.parametrize(("b", "ms"), [(1, 7.09 + 0.021 + 0.000039), (3, 7.09 + 0.084 + 0.000117),
                                       (100, 7.09 + 2.184 + 0.0039), (256, 7.09 + 5.376 + 0.009984)])
def test_h100_plain_step_pads_b_to_its_tier(b: int, ms: float) -> None:
    assert _shipped("h100-llama8b-fitted").plain_seconds(b) == pytest.approx(ms * MS, rel=1e-12)


@pytest.mark.parametrize(("b", "k", "ms"), [(1, 1, 2.14084), (3, 3, 2.14756), (100, 2, 2.308), (256, 3, 2.78512),
                                            (256, 1, 2.35504)])
def test_h100_draft_pays_per_speculative_token(b: int, k: int, ms: float) -> None:
    assert _shipped("h100-llama8b-fitted").draft_seconds(b, k) == pytest.approx(ms * MS, rel=1e-12)


# whole steps, hand-computed: verify or plain + 0.039 us x KV tokens + draft(k, drafting) + 21.0 us x prompt tokens
@pytest.mark.parametrize(("work", "ms"), [
    (StepWork(16, 40, 16 * 123, drafts=3, drafting=16), 7.93156 + 0.076752 + 2.18032),            # 10.188632
    (StepWork(16, 40, 16 * 123, drafts=3, drafting=16, prefill_tokens=100), 10.188632 + 2.1),      # 12.288632
    (StepWork(16, 16, 16 * 123), 7.426624 + 0.076752),                                             # 7.503376
    (StepWork(16, 16, 16 * 123, prefill_tokens=31), 7.503376 + 0.651),                             # 8.154376
    (StepWork(8, 20, 1000, drafts=2, drafting=5), 7.59478 + 0.039 + 2.1484),                       # 9.78218
    (StepWork(256, 1024, 256 * 122, drafts=3, drafting=256), 28.633936 + 1.218048 + 2.78512),      # 32.637104
])
def test_h100_prices_a_step_as_the_sum_of_the_published_terms(work: StepWork, ms: float) -> None:
    assert _shipped("h100-llama8b-fitted").price(work) == pytest.approx(ms * MS, rel=1e-12)


@given(b=st.integers(1, 256), k=st.integers(0, 3), extra=st.integers(0, 3 * 256), context=st.integers(0, 4096),
       drafting=st.integers(0, 256), prompt=st.integers(0, 4096))
def test_h100_equals_the_formula_with_the_capture_tiers_written_out(b, k, extra, context, drafting, prompt) -> None:
    m, d = b + min(extra, k * b), min(drafting, b)
    tiers = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
    rows = m if k else b
    tier = next((t for t in tiers if t >= rows), rows)
    ms = 5.89 + 1.2 + 21.0e-3 * tier + 0.039e-3 * rows + 0.039e-3 * context * b + 21.0e-3 * prompt
    if k and d:
        ms += 2.14 + 0.84e-3 * k * d
    work = StepWork(b, rows, context * b, drafts=k, drafting=d if k else 0, prefill_tokens=prompt)
    assert _shipped("h100-llama8b-fitted").price(work) == pytest.approx(ms * MS, rel=1e-9)


def test_h100_generator_records_the_fit_and_the_capture_tiers() -> None:
    cost = h100_llama8b_fitted(gamma=5, capture_limit=256, max_requests=64)
    assert cost.tiers == (1, 2, 4, *range(8, 256, 8), 256) and cost.width == 6 and cost.max_requests == 64
    assert cost.per_kv_token == 0.039e-6 and cost.prefill == PrefillCost(0.0, 21.0e-6)
    assert cost.parameters["gamma"] == 5 and cost.parameters["capture_limit"] == 256
    assert cost.verify.step_seconds(64, 257) == pytest.approx((7.09 + 21.0e-3 * 257 + 0.039e-3 * 257) * MS,
                                                              rel=1e-12)  # eager past the 256 limit
    assert cost.draft_seconds(64, 5) == pytest.approx((2.14 + 0.84e-3 * 5 * 64) * MS, rel=1e-12)


def test_llama8b_roofline_is_memory_bound_at_small_m_and_compute_bound_at_large_m() -> None:
    cost, t = _shipped("h200-roofline-llama8b"), LLAMA31_8B.forward()
    knee = H200.knee_rows(t, 0)
    assert 150 < knee < 250
    step = cost.verify.step_seconds
    assert step(64, 64) == step(64, 128) == step(64, math.floor(knee))  # weight stream: flat in M
    assert step(64, math.ceil(knee)) > step(64, math.floor(knee))
    assert step(64, 256) - step(64, 255) == pytest.approx(H200.row_seconds(t, 0), rel=1e-9)
    assert step(256, 1024) - step(256, 512) == pytest.approx(512 * H200.row_seconds(t, 0), rel=1e-9)


@pytest.mark.parametrize("name", ["h200-roofline-llama8b", "h200-roofline-smollm2"])
@pytest.mark.parametrize(("b", "m"), [(1, 1), (1, 4), (16, 64), (64, 200), (256, 1024)])
def test_roofline_terms_are_the_roofline_forwards_at_context_zero(name: str, b: int, m: int) -> None:
    cost = _shipped(name)
    t = (LLAMA31_8B if "llama8b" in name else SMOLLM2_135M).forward()
    assert cost.verify.step_seconds(b, m) == pytest.approx(H200.forward_seconds(t, rows=m, requests=b, context=0),
                                                           rel=1e-12)
    assert cost.plain_seconds(b) == pytest.approx(H200.forward_seconds(t, rows=b, requests=b, context=0), rel=1e-12)
    assert cost.per_kv_token == pytest.approx(t.kv_width * 2 / (4.8e12 * 0.74), rel=1e-15)
    assert cost.prefill == PrefillCost(0.0, H200.row_seconds(t, 0))


def test_llama8b_per_kv_token_is_128_kib_over_the_effective_bandwidth() -> None:
    kv_bytes = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head dim x BF16 = 131072 bytes
    assert _shipped("h200-roofline-llama8b").per_kv_token == pytest.approx(kv_bytes / (4.8e12 * 0.74), rel=1e-15)
    assert kv_bytes / (4.8e12 * 0.74) == pytest.approx(36.9e-9, rel=1e-3)


@pytest.mark.parametrize(("b", "m", "context"), [(1, 4, 122), (16, 64, 123), (64, 128, 1024)])
def test_a_memory_bound_llama8b_step_at_context_c_is_the_roofline_forward_at_c(b: int, m: int, context: int) -> None:
    """The KV term reads what the roofline reads at that context; the attention FLOPs it leaves out don't show
    while the step is memory-bound."""
    cost, t = _shipped("h200-roofline-llama8b"), LLAMA31_8B.forward()
    target = cost.price(StepWork(b, m, context * b, drafts=3, drafting=b)) - cost.draft_seconds(b, 3)
    assert target == pytest.approx(H200.forward_seconds(t, rows=m, requests=b, context=context), rel=1e-12)
    assert cost.per_kv_token * context * b > 1e-4 * target  # far above the tolerance: a lost KV term would show


@pytest.mark.parametrize(("name", "k", "n"), [("h200-roofline-llama8b", 1, 1), ("h200-roofline-llama8b", 3, 16),
                                              ("h200-roofline-llama8b", 2, 256), ("h200-roofline-smollm2", 1, 1),
                                              ("h200-roofline-smollm2", 3, 64), ("h200-roofline-smollm2", 2, 256)])
def test_roofline_drafters_are_their_documented_forwards(name: str, k: int, n: int) -> None:
    if "llama8b" in name:  # k forwards of one Llama-3.1-8B layer + a 32,000-token LM head
        forward, times = LlamaGeometry(1, 4096, 14336, 32, 8, 128, 32000).forward(), k
    else:  # one forward of the block draft with k - 1 chain steps and k scorings
        forward, times = SMOLLM2_DRAFT.forward(k), 1
    want = times * H200.forward_seconds(forward, rows=n, requests=n, context=0)
    assert _shipped(name).draft_seconds(n, k) == pytest.approx(want, rel=1e-12)


def test_roofline_reproduces_sglang_h200_qwen3_14b_verify_times() -> None:
    qwen3_14b = LlamaGeometry(num_layers=40, hidden=5120, intermediate=17408, num_heads=40, num_kv_heads=8,
                              head_dim=128, vocab=151936).forward()
    for rows, ms in ((8, 8.71), (16, 8.77), (1024, 42.34)):
        assert H200.forward_seconds(qwen3_14b, rows=rows, requests=0, context=0) == pytest.approx(ms * 1e-3, rel=0.02)


def test_geometries_match_the_published_parameter_counts_and_the_shipped_draft() -> None:
    from dspark.models.draft import WEIGHTS_DIR, DraftConfig

    norms = (2 * 30 + 1) * 576
    assert SMOLLM2_135M.forward().weight_params + norms == 134_515_008  # tied: the LM head is the embedding
    assert LLAMA31_8B.forward().weight_params + 128256 * 4096 + (2 * 32 + 1) * 4096 == 8_030_261_248
    cfg, trained = DraftConfig(hidden_size=576, vocab_size=49152), json.loads(
        (WEIGHTS_DIR / "smollm2_135m_draft.json").read_text())["training"]
    assert (SMOLLM2_DRAFT.num_heads, SMOLLM2_DRAFT.num_kv_heads, SMOLLM2_DRAFT.head_dim) == (
        cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim)
    assert (SMOLLM2_DRAFT.intermediate, SMOLLM2_DRAFT.chain, SMOLLM2_DRAFT.draft_vocab, SMOLLM2_DRAFT.block) == (
        trained["intermediate"], trained["chain"], trained["draft_vocab"], trained["gamma"])


def test_smollm2_is_launch_bound_on_the_h200() -> None:
    cost = _shipped("h200-roofline-smollm2")
    floor = H200.floor_seconds(SMOLLM2_135M.forward())
    assert floor > 0.8 * cost.plain_seconds(1) and cost.verify.step_seconds(1, 4) == cost.verify.step_seconds(1, 1)
    assert cost.draft_seconds(1, 1) < cost.draft_seconds(1, 3) < 0.2 * cost.plain_seconds(1)
    for k in (1, 2, 3):  # its launch floor (the block and one unit per draft) is most of a proposal
        assert (1 + k) * 20e-6 > 0.8 * cost.draft_seconds(1, k)


PERTURBATIONS = dict(spread=st.floats(0.0, 0.5), seed=st.integers(0, 2**32), skew=st.floats(-0.5, 0.5))


@pytest.mark.parametrize("name", sorted(ANALYTIC))
@settings(max_examples=15)
@given(**PERTURBATIONS)
def test_perturbed_is_deterministic_per_seed_and_within_its_bound(name: str, spread: float, seed: int,
                                                                  skew: float) -> None:
    _check_perturbed(_shipped(name), spread, seed, skew)


@settings(max_examples=4)  # each copy of the tabled model checks its coverage in about a second
@given(**PERTURBATIONS)
def test_perturbed_cpu_measured_is_deterministic_per_seed_and_within_its_bound(spread: float, seed: int,
                                                                               skew: float) -> None:
    _check_perturbed(_shipped("cpu-measured"), spread, seed, skew)


def _check_perturbed(cost: ServingCost, spread: float, seed: int, skew: float) -> None:
    copy = perturbed(cost, spread=spread, seed=seed, plain_skew=skew)
    assert copy == perturbed(cost, spread=spread, seed=seed, plain_skew=skew)
    assert copy.width == cost.width and copy.tiers == cost.tiers and copy.max_requests == cost.max_requests
    assert copy.drafter.kind in (cost.drafter.kind, "ngram") and copy.drafter.max_drafts == cost.drafter.max_drafts
    lo, hi = (1 - spread) * (1 - 1e-12), (1 + spread) * (1 + 1e-12)

    def within(new: float, old: float) -> bool:
        return new == old == 0.0 or lo <= new / old <= hi

    for b in (1, 2, 3, 17, 100, 256):
        ratio = copy.verify.seconds_curve(b, b, 3 * b + 1) / cost.verify.seconds_curve(b, b, 3 * b + 1)
        assert ((lo <= ratio) & (ratio <= hi)).all(), (b, ratio.min(), ratio.max())
        assert within(copy.plain_seconds(b) / (1 + skew), cost.plain_seconds(b))
        assert all(within(copy.draft_seconds(b, k), cost.draft_seconds(b, k)) for k in (1, 2, 3))
        work = StepWork(b, 3 * b, 123 * b, drafts=2, drafting=b, prefill_tokens=50)
        assert within(copy.price(work), cost.price(work)), (b, copy.price(work) / cost.price(work))
    assert within(copy.per_kv_token, cost.per_kv_token)
    assert within(copy.prefill.per_forward, cost.prefill.per_forward)
    assert within(copy.prefill.per_token, cost.prefill.per_token)


def test_perturbed_seeds_differ_and_spread_zero_is_the_original_seconds() -> None:
    cost = _shipped("h100-llama8b-fitted")
    a, b = (perturbed(cost, spread=0.05, seed=s) for s in (1, 2))
    assert a.verify != b.verify and a.plain != b.plain and a.per_kv_token != b.per_kv_token
    assert a.drafter.seconds_per_depth != b.drafter.seconds_per_depth and a.prefill.per_token != b.prefill.per_token
    same = perturbed(cost, spread=0.0, seed=3)
    assert same.verify == cost.verify and same.plain == cost.plain and same.drafter == cost.drafter
    assert same.per_kv_token == cost.per_kv_token and same.prefill == cost.prefill
    work = StepWork(16, 40, 16 * 123, drafts=3, drafting=16, prefill_tokens=7)
    assert same.price(work) == cost.price(work) and same.parameters["perturbed"]["seed"] == 3
    skewed = perturbed(cost, spread=0.0, seed=3, plain_skew=-0.1)
    assert skewed.plain_seconds(16) == pytest.approx(0.9 * cost.plain_seconds(16), rel=1e-15)
    assert skewed.price(work) == cost.price(work)  # a speculative step has no plain term


def test_perturbed_keeps_a_drafters_kind_only_where_its_shape_survives() -> None:
    cost = _shipped("h200-roofline-llama8b")  # depth k costs k forwards: far apart, so 1 % keeps the chain
    assert perturbed(cost, spread=0.01, seed=0).drafter.kind == "chain"
    h100 = _shipped("h100-llama8b-fitted")  # depths 0.84 us x n apart on 2.14 ms: 40 % scrambles the order
    kinds = {perturbed(h100, spread=0.4, seed=s).drafter.kind for s in range(20)}
    assert "ngram" in kinds


def _cost(**kw) -> ServingCost:
    good = h100_llama8b_fitted(max_requests=4)
    fields = dict(name="x", platform="h100-cuda", description="", sources=("s",), verify=good.verify,
                  plain=good.plain, per_kv_token=good.per_kv_token, drafter=good.drafter, prefill=good.prefill,
                  max_requests=4)
    return ServingCost(**{**fields, **kw})


def _chain(*depths: tuple[float, ...], probes: tuple[int, ...] = (1, 4)) -> DraftCost:
    return DraftCost("chain", tuple(BatchCurve(probes, d) for d in depths))


@pytest.mark.parametrize(("call", "message"), [
    (lambda: load_serving_cost("h300-nothing"), "unknown serving cost 'h300-nothing'; shipped: ["),
    (lambda: load_serving_cost("h300-nothing"), "'h100-llama8b-fitted', 'h200-roofline-llama8b', 'h200-roofline"),
    (lambda: load_serving_cost("h100-llama8b-fitted", width=8), "W=4, this run has W=8"),
    (lambda: load_serving_cost("h100-llama8b-fitted", width=8), "--write h100-llama8b-fitted --gamma 7"),
    (lambda: load_serving_cost("h100-llama8b-fitted", width=1), "width must be an int >= 2, got 1"),
    (lambda: load_serving_cost(3), "name_or_path must be a str or PathLike"),
    (lambda: BatchCurve((1, 2), (0.1, 0.0)), "seconds[1] must be finite and > 0, got 0.0"),
    (lambda: BatchCurve((1, 2), (0.1, math.nan)), "seconds[1] must be finite and > 0, got nan"),
    (lambda: BatchCurve((1, 2), (0.1, math.inf)), "seconds[1] must be finite and > 0, got inf"),
    (lambda: BatchCurve((2, 1), (0.1, 0.2)), "batch_sizes must be sorted and unique"),
    (lambda: BatchCurve((1, 4), (0.1, 0.2))(5), "num_requests must be in [1, 4]"),
    (lambda: _cost(name=""), "name must be a non-empty string, got ''"),
    (lambda: _cost(sources=()), "sources must be a non-empty list"),
    (lambda: _cost(max_requests=5), "plain must cover B = 1..max_requests = 5"),
    (lambda: _cost(plain=BatchCurve((1, 2), (0.1, 0.2))), "plain must cover B = 1..max_requests = 4, got batch "
                                                          "sizes 1..2"),
    (lambda: _cost(parameters={"x": math.nan}), "parameters must hold JSON values"),
    (lambda: _cost(verify=TieredCostModel(0.01, BatchTerm([1], [0.0]), TierTerm([1, 8], [0.0, 0.001]), width=4)),
     "verify predicts inf s at B=3, M=9"),
    (lambda: _cost(verify=TieredCostModel(0.01, BatchTerm([1], [0.0]), TierTerm([16], [0.0]))), "width None"),
    (lambda: _cost(per_kv_token=-1e-9), "per_kv_token must be a number in [0, inf), got -1e-09"),
    (lambda: _cost(per_kv_token=math.nan), "per_kv_token must be a number in [0, inf), got nan"),
    (lambda: _cost(drafter=_chain((0.1, 0.2), (0.2, 0.3))), "the drafter is priced for depths 1..2 but verify "
                                                            "covers W = 4 (gamma = 3 drafts)"),
    (lambda: _cost(drafter=_chain((0.1, 0.2), (0.2, 0.3), (0.3, 0.4), probes=(1, 3))),
     "drafter depth 1 must cover B = 1..max_requests = 4, got batch sizes 1..3"),
    (lambda: _cost(drafter=_chain((0.1, 0.2), (0.2, 0.3), (0.3, 0.4), (0.4, 0.5))),
     "the drafter is priced for depths 1..4 but verify covers W = 4 (gamma = 3 drafts)"),
    (lambda: _cost(tiers=None), "tiers (() for an eager engine) must be a list or tuple, got NoneType: None"),
    (lambda: _cost(tiers=0), "tiers (() for an eager engine) must be a list or tuple, got int: 0"),
    (lambda: _cost(verify=_shipped("cpu-measured").verify, tiers=(3, 8)),
     "tiers [3, 8] differ from the tiered verify model's [1, 2, 4"),
    (lambda: _cost(parameters={"gamma": 5}), "parameters.gamma 5 differs from the verify model's W - 1 = 3"),
    (lambda: _cost(parameters={"draft_sha256": "zz"}), "parameters.draft_sha256 (or absent) must be a sha256"),
    (lambda: _cost(parameters={"draft_sha256": 123}), "parameters.draft_sha256 (or absent) must be a sha256"),
    (lambda: _cost().price(None), "work must be a StepWork, got NoneType: None"),
    (lambda: load_serving_cost(""), "name_or_path must name a serving cost or a .json file, got ''"),
    (lambda: _cost(drafter="chain"), "drafter must be a DraftCost"),
    (lambda: _cost(prefill=(0.0, 1e-5)), "prefill must be a PrefillCost"),
    (lambda: PrefillCost(-1.0, 1e-5), "per_forward must be a number in [0, inf), got -1.0"),
    (lambda: PrefillCost(0.0, math.inf), "per_token must be a number in [0, inf), got inf"),
    (lambda: _cost().plain_seconds(5), "num_requests must be in [1, max_requests = 4], got 5"),
    (lambda: _cost().draft_seconds(0, 1), "num_requests must be an int >= 1, got 0"),
    (lambda: _cost().draft_seconds(4, 4), "drafts must be in [0, 3] (the depths this drafter is priced for), got 4"),
    (lambda: _cost().price(StepWork(5, 5, 10)), "num_requests must be in [1, max_requests = 4], got 5"),
    (lambda: _cost().price(StepWork(2, 8, 10, drafts=4, drafting=2)), "drafts must be in [0, 3]"),
    (lambda: _cost().believed(2, -1.0), "context must be a number in [0, inf), got -1.0"),
    (lambda: _cost().believed_plain(math.inf), "context must be a number in [0, inf), got inf"),
    (lambda: perturbed(_cost(), spread=1.0, seed=0), "spread must be a number in [0, 1), got 1.0"),
    (lambda: perturbed(_cost(), spread=0.1, seed=-1), "seed must be an int >= 0, got -1"),
    (lambda: perturbed(_cost(), spread=0.1, seed=0, plain_skew=-1.0), "plain_skew must be a number in (-1, inf)"),
    (lambda: perturbed(_cost(verify=ShiftedCostModel(_cost().verify, [1], [1e-3])), spread=0.1, seed=0),
     "perturbed scales cost model kinds ['additive', 'steps_per_second', 'tiered'], got 'shifted'"),
    (lambda: h100_llama8b_fitted(gamma=0), "gamma must be an int >= 1, got 0"),
    (lambda: h200_roofline_smollm2(gamma=7), "gamma must be in [1, 6] (the draft proposes at most 6 tokens"),
    (lambda: h200_roofline_llama8b(max_requests=0), "max_requests must be an int >= 1, got 0"),
    (lambda: h200_roofline_llama8b(draft_vocab=0), "vocab must be an int >= 1, got 0"),
    (lambda: H200.forward_seconds(SMOLLM2_135M.forward(), rows=0, requests=1, context=1), "rows must be an int >= 1"),
    (lambda: fill_monotone(TieredCostModel(0.01, BatchTerm([1], [0.0]), TierTerm([4], [0.0])),
                           [ProfileSample(1, 4, 0.1)]),
     "fill_monotone needs a TieredCostModel with a table"),
])
def test_bad_input_is_refused_naming_the_argument(call, message: str) -> None:
    with pytest.raises((ValueError, TypeError)) as err:
        call()
    assert message in str(err.value)


def test_a_file_of_another_schema_or_with_bad_seconds_is_refused_naming_the_file(tmp_path) -> None:
    cost = _shipped("h100-llama8b-fitted")
    plain_model = cost.verify.save(tmp_path / "model.json")
    with pytest.raises(ValueError, match="model.json: schema must be 'dspark.serving_cost' version 2, got None"):
        load_serving_cost(plain_model)
    d = cost.to_dict()
    d["plain_seconds"]["seconds"][2] = -1.0
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"bad.json: plain_seconds: seconds\[2\] must be finite and > 0, got -1.0"):
        load_serving_cost(tmp_path / "bad.json")
    d["plain_seconds"]["seconds"][2] = 0.01
    theta, d["verify"]["theta"][0] = d["verify"]["theta"][0], math.nan
    (tmp_path / "nan.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"nan.json: verify: theta\[0\] must be finite, got nan"):
        load_serving_cost(tmp_path / "nan.json")
    d["verify"]["theta"][0] = theta
    d["drafter"]["seconds_per_depth"][1]["seconds"][0] = 1e-3  # depth 2 now cheaper than depth 1 at B = 1
    (tmp_path / "shallow.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"shallow.json: drafter: a chain drafter pays per drafted position, but "
                                         r"depth 2 costs 0.001 s at B=1, less than depth 1"):
        load_serving_cost(tmp_path / "shallow.json")
    del d["prefill"]
    (tmp_path / "short.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"short.json: serving cost is missing \['prefill'\]"):
        load_serving_cost(tmp_path / "short.json")


def test_a_file_with_unknown_fields_a_bad_version_or_unreadable_bytes_is_refused_naming_it(tmp_path) -> None:
    d = _shipped("h100-llama8b-fitted").to_dict()
    bad = {"typo.json": {**{k: v for k, v in d.items() if k != "kv_layout"}, "kv_layuot": "padded"},
           "float.json": {**d, "schema_version": 2.0}, "bool.json": {**d, "schema_version": True}}
    for name, body in bad.items():
        (tmp_path / name).write_text(json.dumps(body))
    with pytest.raises(ValueError, match=r"typo.json: serving cost has unknown fields \['kv_layuot'\]"):
        load_serving_cost(tmp_path / "typo.json")
    for name, shown in (("float.json", "2.0"), ("bool.json", "True")):
        with pytest.raises(ValueError, match=rf"{name}: schema_version must be an int \(2\), got {shown}"):
            load_serving_cost(tmp_path / name)
    (tmp_path / "bytes.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=r"bytes.json is not valid JSON \(not UTF-8 text"):
        load_serving_cost(tmp_path / "bytes.json")
    with pytest.raises(FileNotFoundError, match=r"nothing.json': no such JSON file"):
        load_serving_cost(tmp_path / "nothing.json")
    demo = tmp_path / "demo_out"
    demo.mkdir()
    _shipped("cpu-measured").save(demo / "serving_cost.json")
    with pytest.raises(ValueError, match=r"demo_out' is a folder, not a .json file; a demo's profile is .*"
                                         r"demo_out/serving_cost.json"):
        load_serving_cost(demo)


def test_a_version_1_file_is_refused_with_the_command_that_regenerates_it(tmp_path) -> None:
    """The layout version 1 wrote (speculative / draft_seconds at one fixed context, gamma drafts per step)."""
    curve = {"batch_sizes": [1, 256], "seconds": [0.007, 0.012]}
    v1 = {"schema": SCHEMA, "schema_version": 1, "name": "h100-llama8b-fitted", "platform": "h100-cuda",
          "description": "", "sources": ["s"], "max_requests": 256, "tiers": [], "parameters": {"context": 1024},
          "speculative": _shipped("h100-llama8b-fitted").verify.to_dict(), "plain_seconds": curve,
          "draft_seconds": curve}
    (tmp_path / "old.json").write_text(json.dumps(v1))
    with pytest.raises(ValueError) as err:
        load_serving_cost(tmp_path / "old.json")
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'old.json'}: schema version 1")
    assert "regenerate the file (python -m dspark.lab.cost_models --write NAME) for version 2" in message
    v2 = _shipped("h100-llama8b-fitted").to_dict()  # a version-2 body stamped version 1 is refused the same way
    (tmp_path / "stamped.json").write_text(json.dumps({**v2, "schema_version": 1}))
    with pytest.raises(ValueError, match="stamped.json: schema version 1 .* regenerate the file"):
        load_serving_cost(tmp_path / "stamped.json")
    (tmp_path / "future.json").write_text(json.dumps({**v2, "schema_version": 3}))
    with pytest.raises(ValueError, match="future.json: schema must be 'dspark.serving_cost' version 2, got "
                                         "'dspark.serving_cost' version 3"):
        load_serving_cost(tmp_path / "future.json")


def test_the_command_refuses_a_bad_gamma_naming_it(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--write", "h200-roofline-smollm2", "--gamma", "9"])
    assert "gamma must be in [1, 6]" in capsys.readouterr().err
