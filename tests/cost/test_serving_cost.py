"""Serving cost models: the JSON format, the shipped files (their coverage, and the analytic ones re-made bit for
bit by their generators), the published H100 formula at tier tops, the H200 roofline's regimes, `perturbed`, and
the errors a bad input gets."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.cost import ProfileSample, TieredCostModel
from dspark.cost.roofline import LlamaGeometry
from dspark.cost.serving import (
    COST_MODELS_DIR,
    BatchCurve,
    ServingCost,
    load_serving_cost,
    perturbed,
    serving_cost_names,
)
from dspark.cost.shipped import (
    ANALYTIC,
    GENERATORS,
    H200,
    LLAMA31_8B,
    SMOLLM2_135M,
    SMOLLM2_DRAFT,
    doublings,
    fill_monotone,
    h100_llama8b_fitted,
    h200_roofline_llama8b,
    h200_roofline_smollm2,
    main,
)

pytestmark = pytest.mark.cpu_only(reason="serving cost files and arithmetic (host numpy)")

SHIPPED = ("cpu-measured", "h100-llama8b-fitted", "h200-roofline-llama8b", "h200-roofline-smollm2")
SMALL = {"h100-llama8b-fitted": h100_llama8b_fitted, "h200-roofline-smollm2": h200_roofline_smollm2,
         "h200-roofline-llama8b": h200_roofline_llama8b}


def _curves(cost: ServingCost):
    """(B, seconds of M = B .. B*W) for every covered B."""
    for b in range(1, cost.max_requests + 1):
        yield b, cost.speculative.seconds_curve(b, b, b * (cost.width - 1) + 1)


def test_every_shipped_file_loads_and_covers_every_b_and_m_non_decreasing_in_m() -> None:
    assert serving_cost_names() == list(SHIPPED)
    for name in SHIPPED:
        cost = load_serving_cost(name)
        assert cost.name == name and cost.max_requests == 256 and cost.width == 4
        for b, seconds in _curves(cost):
            assert np.isfinite(seconds).all() and (seconds > 0).all(), (name, b)
            assert (np.diff(seconds) >= 0).all(), (name, b, np.diff(seconds).min())
        assert all(cost.plain_seconds(b) > 0 and cost.draft_seconds(b) > 0 for b in range(1, 257))


@pytest.mark.parametrize("name", ANALYTIC)
def test_the_analytic_files_are_their_generators_output_bit_for_bit(name: str, tmp_path) -> None:
    written = GENERATORS[name]().save(tmp_path / f"{name}.json")
    assert written.read_bytes() == (COST_MODELS_DIR / f"{name}.json").read_bytes()
    assert main(["--write", name, "--out", str(tmp_path / "cli.json")]).read_bytes() == written.read_bytes()


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
    model = TieredCostModel(0.0, probes, [0.0] * len(probes), tiers, [0.0] * len(tiers), table=table, width=w)
    filled = fill_monotone(model, samples)
    for s in samples:
        assert filled.table[probes.index(s.num_requests)][tiers.index(s.rows)] == s.seconds
    for b in range(probes[0], probes[-1] + 1):  # up to float rounding of the interpolation (one ulp of 1 s)
        assert (np.diff(filled.seconds_curve(b, b, b * (w - 1) + 1)) >= -1e-12).all()


def test_the_cpu_file_is_the_demo_profile_of_the_shipped_models() -> None:
    cost = load_serving_cost("cpu-measured")
    assert isinstance(cost.speculative, TieredCostModel) and cost.speculative.table is not None
    assert cost.platform.endswith("-cpu") and cost.speculative.platform == cost.platform
    assert cost.tiers == cost.speculative.tiers and cost.parameters["gamma"] == 3
    assert cost.plain.batch_sizes == cost.draft.batch_sizes == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    step = cost.speculative.step_seconds
    for t in (64, 128, 256):  # past the profiled B = 64: B / 64 steps of 64 requests, same rows per request
        assert step(128, 2 * t) == pytest.approx(2 * step(64, t), rel=1e-12)
        assert step(256, 4 * t) == pytest.approx(4 * step(64, t), rel=1e-12)
    assert cost.plain_seconds(256) == pytest.approx(4 * cost.plain_seconds(64), rel=1e-12)


@pytest.mark.parametrize(("start", "top", "out"), [(64, 256, [128, 256]), (64, 200, [128, 200]), (64, 64, []),
                                                   (1, 5, [2, 4, 5])])
def test_doublings(start: int, top: int, out: list) -> None:
    assert doublings(start, top) == out


@settings(max_examples=10)
@given(name=st.sampled_from(sorted(SMALL)), gamma=st.integers(1, 6), context=st.integers(0, 4096),
       max_requests=st.integers(1, 24))
def test_save_load_round_trip_is_equal(tmp_path_factory, name: str, gamma: int, context: int,
                                       max_requests: int) -> None:
    cost = SMALL[name](gamma=gamma, context=context, max_requests=max_requests)
    path = cost.save(tmp_path_factory.mktemp("rt") / "cost.json")
    again = load_serving_cost(path, width=gamma + 1)
    assert again == cost and again.to_dict() == cost.to_dict()
    assert again.plain_seconds(max_requests) == cost.plain_seconds(max_requests)


@settings(max_examples=10)
@given(name=st.sampled_from(sorted(SMALL)), gamma=st.integers(1, 6), max_requests=st.integers(1, 40))
def test_generators_cover_every_b_and_m_non_decreasing(name: str, gamma: int, max_requests: int) -> None:
    cost = SMALL[name](gamma=gamma, max_requests=max_requests)
    for _, seconds in _curves(cost):
        assert (seconds > 0).all() and (np.diff(seconds) >= 0).all()


@pytest.mark.parametrize("gen", [h100_llama8b_fitted, h200_roofline_llama8b])
def test_gamma_7_covers_b_256_up_to_m_2048(gen) -> None:
    cost = gen(gamma=7)
    assert cost.width == 8 and math.isfinite(cost.speculative.step_seconds(256, 2048))


# H100 fit: T = 5.89 ms + 21.0 us x tier(M) + 0.039 us x (B x 1024 + M) + 1.2 ms + 2.14 ms + 0.84 us x 3 B
@pytest.mark.parametrize(("b", "m", "ms"), [
    (1, 8, 5.89 + 1.2 + 2.14 + 0.168 + 0.040248 + 0.00252),            # 9.440768
    (16, 64, 9.23 + 1.344 + 0.641472 + 0.04032),                       # 11.255792
    (64, 256, 9.23 + 5.376 + 2.565888 + 0.16128),                      # 17.333168
    (3, 9, 9.23 + 0.336 + 0.120159 + 0.00756),                         # padded to tier 16: 9.693719
    (130, 520, 9.23 + 10.92 + 5.21196 + 0.3276),                       # past 512, eager: 25.68956
    (256, 1024, 9.23 + 21.504 + 10.263552 + 0.64512),                  # 41.642672
])
def test_h100_reproduces_the_published_formula(b: int, m: int, ms: float) -> None:
    cost = load_serving_cost("h100-llama8b-fitted", width=4)
    assert cost.speculative.step_seconds(b, m) == pytest.approx(ms * 1e-3, rel=1e-12)


@pytest.mark.parametrize(("b", "ms"), [(1, 7.09 + 0.021 + 0.039975), (100, 7.09 + 2.184 + 3.9975),
                                       (256, 7.09 + 5.376 + 10.2336)])
def test_h100_plain_step_pads_b_to_its_tier(b: int, ms: float) -> None:
    cost = load_serving_cost("h100-llama8b-fitted")
    assert cost.plain_seconds(b) == pytest.approx(ms * 1e-3, rel=1e-12)
    assert cost.draft_seconds(b) == pytest.approx(2.14e-3 + 0.84e-6 * 3 * b, rel=1e-12)


@given(b=st.integers(1, 256), extra=st.integers(0, 3 * 256))
def test_h100_equals_the_formula_with_the_capture_tiers_written_out(b: int, extra: int) -> None:
    m = b + min(extra, 3 * b)
    tiers = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
    tier = next((t for t in tiers if t >= m), m)
    ms = 5.89 + 1.2 + 2.14 + 21.0e-3 * tier + 0.039e-3 * (1024 * b + m) + 0.84e-3 * 3 * b
    assert load_serving_cost("h100-llama8b-fitted").speculative.step_seconds(b, m) == pytest.approx(ms * 1e-3, rel=1e-9)


def test_llama8b_roofline_is_memory_bound_at_small_m_and_compute_bound_at_large_m() -> None:
    cost, t = load_serving_cost("h200-roofline-llama8b"), LLAMA31_8B.forward()
    knee = H200.knee_rows(t, 1024)
    assert 150 < knee < 250
    step = cost.speculative.step_seconds
    assert step(64, 64) == step(64, 128) == step(64, math.floor(knee))  # weight stream: flat in M
    assert step(64, math.ceil(knee)) > step(64, math.floor(knee))
    assert step(64, 256) - step(64, 255) == pytest.approx(H200.row_seconds(t, 1024), rel=1e-9)
    assert step(256, 1024) - step(256, 512) == pytest.approx(512 * H200.row_seconds(t, 1024), rel=1e-9)


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
    cost = load_serving_cost("h200-roofline-smollm2")
    floor = H200.floor_seconds(SMOLLM2_135M.forward())
    assert floor > 0.8 * cost.plain_seconds(1) and cost.draft_seconds(1) < 0.2 * cost.plain_seconds(1)


@settings(max_examples=15)
@given(name=st.sampled_from(SHIPPED), spread=st.floats(0.0, 0.5), seed=st.integers(0, 2**32),
       skew=st.floats(-0.5, 0.5))
def test_perturbed_is_deterministic_per_seed_and_within_its_bound(name: str, spread: float, seed: int,
                                                                  skew: float) -> None:
    cost = load_serving_cost(name)
    copy = perturbed(cost, spread=spread, seed=seed, plain_skew=skew)
    assert copy == perturbed(cost, spread=spread, seed=seed, plain_skew=skew)
    assert copy.width == cost.width and copy.tiers == cost.tiers
    lo, hi = (1 - spread) * (1 - 1e-12), (1 + spread) * (1 + 1e-12)
    for b in (1, 2, 3, 17, 100, 256):
        ratio = copy.speculative.seconds_curve(b, b, 3 * b + 1) / cost.speculative.seconds_curve(b, b, 3 * b + 1)
        assert ((lo <= ratio) & (ratio <= hi)).all(), (b, ratio.min(), ratio.max())
        assert lo <= copy.plain_seconds(b) / cost.plain_seconds(b) / (1 + skew) <= hi
        assert lo <= copy.draft_seconds(b) / cost.draft_seconds(b) <= hi


def test_perturbed_seeds_differ_and_spread_zero_is_the_original_seconds() -> None:
    cost = load_serving_cost("h100-llama8b-fitted")
    a, b = (perturbed(cost, spread=0.05, seed=s) for s in (1, 2))
    assert a.speculative != b.speculative and a.plain != b.plain
    same = perturbed(cost, spread=0.0, seed=3)
    assert same.speculative == cost.speculative and same.plain == cost.plain and same.draft == cost.draft
    skewed = perturbed(cost, spread=0.0, seed=3, plain_skew=-0.1)
    assert skewed.plain_seconds(16) == pytest.approx(0.9 * cost.plain_seconds(16), rel=1e-15)


def _cost(**kw) -> ServingCost:
    good = h100_llama8b_fitted(max_requests=4)
    fields = dict(name="x", platform="h100-cuda", description="", sources=("s",), speculative=good.speculative,
                  plain=good.plain, draft=good.draft, max_requests=4)
    return ServingCost(**{**fields, **kw})


@pytest.mark.parametrize(("call", "message"), [
    (lambda: load_serving_cost("h300-nothing"), "unknown serving cost 'h300-nothing'; shipped: ["),
    (lambda: load_serving_cost("h300-nothing"), "'h100-llama8b-fitted', 'h200-roofline-llama8b', 'h200-roofline"),
    (lambda: load_serving_cost("h100-llama8b-fitted", width=8), "W=4, this run has W=8"),
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
    (lambda: _cost(parameters={"x": math.nan}), "parameters must hold JSON values"),
    (lambda: _cost(speculative=TieredCostModel(0.01, [1], [0.0], [1, 8], [0.0, 0.001], width=4)),
     "speculative predicts inf s at B=3, M=9"),
    (lambda: _cost(speculative=TieredCostModel(0.01, [1], [0.0], [16], [0.0])), "width None"),
    (lambda: _cost().plain_seconds(5), "num_requests must be in [1, max_requests = 4], got 5"),
    (lambda: _cost().draft_seconds(0), "num_requests must be an int >= 1, got 0"),
    (lambda: perturbed(_cost(), spread=1.0, seed=0), "spread must be a number in [0, 1), got 1.0"),
    (lambda: perturbed(_cost(), spread=0.1, seed=-1), "seed must be an int >= 0, got -1"),
    (lambda: perturbed(_cost(), spread=0.1, seed=0, plain_skew=-1.0), "plain_skew must be a number in (-1, inf)"),
    (lambda: h100_llama8b_fitted(gamma=0), "gamma must be an int >= 1, got 0"),
    (lambda: h200_roofline_smollm2(gamma=7), "gamma must be in [1, 6] (the draft proposes at most 6 tokens"),
    (lambda: h200_roofline_llama8b(context=-1), "context must be an int >= 0, got -1"),
    (lambda: H200.forward_seconds(SMOLLM2_135M.forward(), rows=0, requests=1, context=1), "rows must be an int >= 1"),
    (lambda: fill_monotone(TieredCostModel(0.01, [1], [0.0], [4], [0.0]), [ProfileSample(1, 4, 0.1)]),
     "fill_monotone needs a TieredCostModel with a table"),
])
def test_bad_input_is_refused_naming_the_argument(call, message: str) -> None:
    with pytest.raises((ValueError, TypeError)) as err:
        call()
    assert message in str(err.value)


def test_a_file_of_another_schema_or_with_bad_seconds_is_refused_naming_the_file(tmp_path) -> None:
    cost = load_serving_cost("h100-llama8b-fitted")
    plain_model = cost.speculative.save(tmp_path / "model.json")
    with pytest.raises(ValueError, match="model.json: schema must be 'dspark.serving_cost' version 1, got None"):
        load_serving_cost(plain_model)
    d = cost.to_dict()
    d["plain_seconds"]["seconds"][2] = -1.0
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"bad.json: plain_seconds: seconds\[2\] must be finite and > 0, got -1.0"):
        load_serving_cost(tmp_path / "bad.json")
    d["plain_seconds"]["seconds"][2] = 0.01
    d["speculative"]["theta"][0] = math.nan
    (tmp_path / "nan.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"nan.json: speculative: theta\[0\] must be finite, got nan"):
        load_serving_cost(tmp_path / "nan.json")
    del d["draft_seconds"]
    (tmp_path / "short.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"serving cost is missing \['draft_seconds'\]"):
        load_serving_cost(tmp_path / "short.json")


def test_the_command_refuses_a_bad_gamma_naming_it(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--write", "h200-roofline-smollm2", "--gamma", "9"])
    assert "gamma must be in [1, 6]" in capsys.readouterr().err
