"""`ServingCost.price(StepWork)` against a brute-force reference written here from the formula (docs/replay.md,
dspark/cost/serving.py's docstring), on random serving costs of every drafter kind and on the shipped files;
`DraftCost`'s kinds and the shapes each refuses; a drafter without a kind; what a planner believes
(`believed`, `believed_plain`) against the price of the step it plans.

    speculative step:  verify.T(B, M) + per_kv_token x kv_tokens + drafter(k, drafting) + prefill(P)
    plain step:        plain(B)       + per_kv_token x kv_tokens                        + prefill(P)

Tests that read graphs/cost_models/cpu-measured.json carry `cpu_measured` in their id (`-k "not cpu_measured"`
leaves them out)."""
from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.cost import AdditiveCostModel, BatchTerm, RowTerm, TieredCostModel, TierTerm
from dspark.cost.serving import (
    DRAFTER_KINDS,
    KV_LAYOUTS,
    BatchCurve,
    DraftCost,
    PrefillCost,
    ServingCost,
    StepWork,
    load_serving_cost,
    serving_cost_names,
)
from dspark.cost.shifted import ShiftedCostModel
from dspark.cost.shipped import h100_llama8b_fitted

pytestmark = pytest.mark.cpu_only(reason="serving cost arithmetic (host numpy)")

SHIPPED = tuple(serving_cost_names())  # every file in graphs/cost_models/


def _id(name: str) -> str:
    return name.replace("-", "_")


@functools.lru_cache(maxsize=None)
def _shipped(name: str) -> ServingCost:
    return load_serving_cost(name)


# ---- the reference: the formula over the JSON a cost saves, numpy only (no dspark cost code) ----

def _verify_reference(v: dict, b: int, m: int) -> float:
    if v["kind"] == "additive":
        return v["bias"] + np.interp(b, v["batch_probes"], v["alpha"]) + np.interp(m, v["row_probes"], v["theta"])
    assert v["kind"] == "tiered", v["kind"]
    i = next(i for i, t in enumerate(v["tiers"]) if t >= m)  # coverage: every M <= B x W has a tier
    if "table" in v and v["table"] is not None:
        return float(np.interp(b, v["batch_probes"], [row[i] for row in v["table"]]))
    return v["bias"] + np.interp(b, v["batch_probes"], v["alpha"]) + v["phi"][i]


def _curve_reference(c: dict, x: int) -> float:
    return float(np.interp(x, c["batch_sizes"], c["seconds"]))


def _reference_parts(d: dict, w: StepWork) -> tuple[float, float, float, float]:
    """(target, KV, draft, prefill) seconds of step `w` under the serving cost saved as `d`."""
    target = _verify_reference(d["verify"], w.requests, w.rows) if w.drafts else _curve_reference(
        d["plain_seconds"], w.requests)
    draft = _curve_reference(d["drafter"]["seconds_per_depth"][w.drafts - 1], w.drafting) + d["drafter"].get(
        "per_catch_up_token", 0.0) * w.catch_up if (w.drafts and w.drafting) else 0.0
    prefill = d["prefill"]["per_token"] * w.prefill_tokens  # folded into the step's forward: no forward of its own
    prefill += d["prefill"]["per_forward"] if w.prefill_tokens and not w.prefill_folded else 0.0
    padded = d.get("kv_layout", "ragged") == "padded" and w.kv_longest is not None
    kv = w.requests * w.kv_longest if padded else w.kv_tokens
    return target, d["per_kv_token"] * kv, draft, prefill


# ---- random serving costs: every drafter kind, additive or tabled tiered verify ----

def _probes(draw, top: int) -> list[int]:
    inner = draw(st.lists(st.integers(1, top), max_size=4))
    return sorted({1, top, *inner})


@st.composite
def serving_costs(draw) -> ServingCost:
    max_requests, gamma = draw(st.integers(1, 12)), draw(st.integers(1, 4))
    w, sec = gamma + 1, st.floats(1e-4, 1e-1)
    bp = _probes(draw, max_requests)
    if draw(st.booleans()):
        rp = _probes(draw, max_requests * w)
        alpha = BatchTerm(bp, draw(st.lists(sec, min_size=len(bp), max_size=len(bp))))
        theta = RowTerm(rp, draw(st.lists(sec, min_size=len(rp), max_size=len(rp))))
        verify = AdditiveCostModel(draw(st.floats(1e-4, 1e-2)), alpha, theta, width=w)
    else:
        tiers = _probes(draw, max_requests * w)
        table = [draw(st.lists(sec, min_size=len(tiers), max_size=len(tiers))) for _ in bp]
        verify = TieredCostModel(0.0, BatchTerm(bp, [0.0] * len(bp)), TierTerm(tiers, [0.0] * len(tiers)), table=table,
                                 width=w)
    pp = _probes(draw, max_requests)
    plain = BatchCurve(pp, draw(st.lists(sec, min_size=len(pp), max_size=len(pp))))
    kind, dp = draw(st.sampled_from(DRAFTER_KINDS)), _probes(draw, max_requests)
    first = draw(st.lists(st.floats(1e-5, 1e-2), min_size=len(dp), max_size=len(dp)))
    depths = [first]
    for _ in range(1, gamma):
        if kind == "chain":  # each depth = the one before + a non-negative increment per probe
            step = draw(st.lists(st.floats(0.0, 1e-2), min_size=len(dp), max_size=len(dp)))
            depths.append([a + s for a, s in zip(depths[-1], step)])
        elif kind == "parallel":
            depths.append(list(first))
        else:
            depths.append(draw(st.lists(st.floats(1e-5, 1e-2), min_size=len(dp), max_size=len(dp))))
    drafter = DraftCost(kind, tuple(BatchCurve(dp, s) for s in depths), draw(st.floats(0.0, 1e-4)))
    prefill = PrefillCost(draw(st.floats(0.0, 1e-2)), draw(st.floats(1e-7, 1e-4)))
    return ServingCost("random", "test", "", ("hypothesis",), verify, plain, draw(st.floats(1e-9, 1e-6)), drafter,
                       prefill, max_requests=max_requests, parameters={"gamma": gamma},
                       kv_layout=draw(st.sampled_from(KV_LAYOUTS)))


def _work(draw, cost: ServingCost) -> StepWork:
    b = draw(st.integers(1, cost.max_requests))
    k = draw(st.integers(0, cost.width - 1))
    rows = draw(st.integers(b, b * (k + 1))) if k else b
    drafting = draw(st.integers(0, b)) if k else 0
    cached = draw(st.lists(st.integers(0, 4096), min_size=b, max_size=b))
    return StepWork(b, rows, sum(cached), drafts=k, drafting=drafting, prefill_tokens=draw(st.integers(0, 4096)),
                    catch_up=draw(st.integers(0, 512)) if drafting else 0,
                    kv_longest=draw(st.sampled_from([None, max(cached)])), prefill_folded=draw(st.booleans()))


def _check_price(cost: ServingCost, work: StepWork) -> None:
    parts = _reference_parts(cost.to_dict(), work)
    assert cost.price(work) == pytest.approx(sum(parts), rel=1e-12, abs=0), (work, parts)
    target = cost.verify.step_seconds(work.requests, work.rows) if work.drafts else cost.plain_seconds(work.requests)
    assert float(target) == pytest.approx(parts[0], rel=1e-12)
    padded = cost.kv_layout == "padded" and work.kv_longest is not None
    kv = work.requests * work.kv_longest if padded else work.kv_tokens
    assert cost.per_kv_token * kv == pytest.approx(parts[1], rel=1e-12, abs=0)
    draft = cost.draft_seconds(work.drafting, work.drafts, work.catch_up) if work.drafting else 0.0
    assert draft == pytest.approx(parts[2], rel=1e-12, abs=0)
    assert cost.prefill.seconds(work.prefill_tokens, work.prefill_folded) == pytest.approx(parts[3], rel=1e-12, abs=0)


@settings(max_examples=60)
@given(data=st.data(), cost=serving_costs())
def test_price_is_the_sum_of_its_parts_on_random_costs(data, cost: ServingCost) -> None:
    for _ in range(3):
        _check_price(cost, _work(data.draw, cost))


@pytest.mark.parametrize("name", SHIPPED, ids=_id)
@settings(max_examples=40)
@given(data=st.data())
def test_price_is_the_sum_of_its_parts_on_every_shipped_file(name: str, data) -> None:
    _check_price(_shipped(name), _work(data.draw, _shipped(name)))


@pytest.mark.parametrize("name", SHIPPED, ids=_id)
@pytest.mark.parametrize(("b", "k"), [(1, 1), (7, 2), (64, 3), (256, 3)])
def test_each_part_moves_the_price_by_its_own_term(name: str, b: int, k: int) -> None:
    cost = _shipped(name)
    base = StepWork(b, b * (k + 1), 100 * b, drafts=k, drafting=b, prefill_tokens=0)
    price = cost.price(base)
    assert cost.price(StepWork(b, b, 100 * b)) == pytest.approx(  # drafts 0: the plain step, B rows
        cost.plain_seconds(b) + cost.per_kv_token * 100 * b, rel=1e-12)
    more_kv = StepWork(b, b * (k + 1), 150 * b, drafts=k, drafting=b)
    assert cost.price(more_kv) - price == pytest.approx(cost.per_kv_token * 50 * b, rel=1e-6, abs=1e-15)
    prompt = StepWork(b, b * (k + 1), 100 * b, drafts=k, drafting=b, prefill_tokens=77)
    assert cost.price(prompt) - price == pytest.approx(cost.prefill.per_forward + cost.prefill.per_token * 77,
                                                       rel=1e-9)
    riding = dataclasses.replace(prompt, prefill_folded=True)  # chunked prefill: the rows it adds, no forward
    assert cost.price(riding) - price == pytest.approx(cost.prefill.per_token * 77, rel=1e-9)
    no_draft = StepWork(b, b * (k + 1), 100 * b, drafts=k, drafting=0)
    assert price - cost.price(no_draft) == pytest.approx(cost.draft_seconds(b, k), rel=1e-9)
    assert cost.draft_seconds(b, k) > 0 and cost.prefill.per_token > 0


# ---- drafter kinds ----

@pytest.mark.parametrize("name", SHIPPED, ids=_id)
def test_a_shipped_chain_drafter_pays_more_for_deeper_drafts(name: str) -> None:
    cost = _shipped(name)
    assert cost.drafter.kind == "chain"
    for b in (1, 5, 64, 256):
        rows = 2 * b  # the same verify rows: only the proposal's depth changes
        prices = [cost.price(StepWork(b, rows, 50 * b, drafts=k, drafting=b)) for k in (1, 2, 3)]
        assert prices[0] < prices[2] and prices == sorted(prices), (b, prices)


def test_chain_parallel_and_ngram_price_what_they_hold() -> None:
    probes = (1, 8)
    chain = DraftCost("chain", (BatchCurve(probes, (1e-3, 2e-3)), BatchCurve(probes, (2e-3, 4e-3)),
                                BatchCurve(probes, (2e-3, 5e-3))))  # equal depths are allowed (non-decreasing)
    assert [chain.seconds(k, 8) for k in (1, 2, 3)] == [2e-3, 4e-3, 5e-3]
    assert chain.seconds(2, 4) == pytest.approx(2e-3 + 3 / 7 * 2e-3, rel=1e-12) and chain.max_drafts == 3
    parallel = DraftCost("parallel", tuple(BatchCurve(probes, (3e-3, 6e-3)) for _ in range(4)))
    assert {parallel.seconds(k, 8) for k in (1, 2, 3, 4)} == {6e-3}
    ngram = DraftCost("ngram", (BatchCurve(probes, (1e-5, 3e-5)), BatchCurve(probes, (1e-6, 1e-6))))
    assert ngram.seconds(2, 1) < ngram.seconds(1, 1)  # any shape: a host lookup
    assert chain.seconds(0, 8) == chain.seconds(3, 0) == 0.0
    assert DraftCost.from_dict(chain.to_dict()) == chain and DraftCost.from_dict(parallel.to_dict()) == parallel


def _curves(*depths: tuple[float, ...], probes: tuple[int, ...] = (1, 4)) -> tuple[BatchCurve, ...]:
    return tuple(BatchCurve(probes, d) for d in depths)


@pytest.mark.parametrize(("kind", "curves", "message"), [
    ("parallel", _curves((1e-3, 2e-3), (1e-3, 2.1e-3)),
     "a parallel drafter runs one forward whatever k, but depth 2 costs 0.0021 s at B=4 against 0.002 s at depth 1"),
    ("parallel", _curves((1e-3, 2e-3), (1e-3, 2e-3), (1.5e-3, 2e-3)),
     "a parallel drafter runs one forward whatever k, but depth 3 costs 0.0015 s at B=1 against 0.001 s at depth 2"),
    ("chain", _curves((1e-3, 2e-3), (1.5e-3, 3e-3), (1.4e-3, 3e-3)),
     "a chain drafter pays per drafted position, but depth 3 costs 0.0014 s at B=1, less than depth 2 (0.0015 s)"),
    ("chain", _curves((1e-3, 4e-3), probes=(1, 8)) + (BatchCurve((1, 4, 8), (2e-3, 2e-3, 5e-3)),),
     "depth 2 costs 0.002 s at B=4, less than depth 1 (0.00228571"),  # a dip at a probe of the deeper curve only
    ("tree", _curves((1e-3, 2e-3)), "drafter kind must be one of ('chain', 'parallel', 'ngram'), got 'tree'"),
    ("", _curves((1e-3, 2e-3)), "drafter kind must be one of ('chain', 'parallel', 'ngram'), got ''"),
    ("chain", (), "seconds_per_depth must hold one batch curve per draft depth 1..gamma, got none"),
    ("chain", _curves((1e-3, 2e-3)) + ((1, 2),), "seconds_per_depth[1] must be a BatchCurve"),
])
def test_a_drafter_of_the_wrong_shape_is_refused_naming_the_depth(kind: str, curves, message: str) -> None:
    with pytest.raises((ValueError, TypeError)) as err:
        DraftCost(kind, curves)
    assert message in str(err.value)


@pytest.mark.parametrize(("d", "message"), [
    ({"seconds_per_depth": [{"batch_sizes": [1], "seconds": [1e-3]}]}, "the drafter must name its kind"),
    ({"kind": "chain", "seconds_per_depth": [], "extra": 1}, "a drafter must hold kind, seconds_per_depth and optionally per_catch_up_token"),
    ({"kind": "chain", "seconds_per_depth": {"batch_sizes": [1]}}, "seconds_per_depth must be a list"),
])
def test_a_drafter_dict_of_the_wrong_shape_is_refused(d: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError)) as err:
        DraftCost.from_dict(d)
    assert message in str(err.value)


def test_a_serving_cost_file_whose_drafter_names_no_kind_is_refused_naming_kind(tmp_path) -> None:
    d = h100_llama8b_fitted(max_requests=4).to_dict()
    del d["drafter"]["kind"]
    (tmp_path / "nokind.json").write_text(json.dumps(d))
    with pytest.raises(ValueError) as err:
        load_serving_cost(tmp_path / "nokind.json")
    assert str(err.value).startswith(f"{tmp_path / 'nokind.json'}: drafter: ")
    assert "names no drafter kind; add \"kind\": one of ('chain', 'parallel', 'ngram')" in str(err.value)
    with pytest.raises(ValueError, match="drafter: the serving cost 'h100-llama8b-fitted' names no drafter kind"):
        ServingCost.from_dict(d)
    d["drafter"]["kind"] = "parallel"  # the fit's depths differ: not a parallel drafter
    (tmp_path / "parallel.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"parallel.json: drafter: a parallel drafter runs one forward whatever k"):
        load_serving_cost(tmp_path / "parallel.json")
    d["drafter"]["kind"] = "chain"
    (tmp_path / "chain.json").write_text(json.dumps(d))
    assert load_serving_cost(tmp_path / "chain.json").drafter.kind == "chain"


@settings(max_examples=30)
@given(cost=serving_costs())
def test_random_costs_of_every_drafter_kind_round_trip(tmp_path_factory, cost: ServingCost) -> None:
    again = load_serving_cost(cost.save(tmp_path_factory.mktemp("rt") / "c.json"), width=cost.width)
    assert again == cost and again.drafter.kind == cost.drafter.kind and again.to_dict() == cost.to_dict()
    b = cost.max_requests
    work = StepWork(b, b * cost.width, 7 * b, drafts=cost.width - 1, drafting=b, prefill_tokens=3)
    assert again.price(work) == cost.price(work) > 0


# ---- what a planner believes ----

def _check_believed(cost: ServingCost, k: int, context: int, b: int) -> None:
    believed = cost.believed(k, context)
    assert isinstance(believed, ShiftedCostModel) and believed.width == k + 1
    rows = list(range(b, b * (k + 1) + 1))
    want = [cost.price(StepWork(b, m, kv_tokens=context * b, drafts=k, drafting=b)) for m in rows]
    got = [float(believed.step_seconds(b, m)) for m in rows]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_allclose(believed.seconds_curve(b, b, len(rows)), want, rtol=1e-12)  # the budget path
    assert cost.believed_plain(context)(b) == pytest.approx(cost.price(StepWork(b, b, kv_tokens=context * b)),
                                                             rel=1e-12)


@settings(max_examples=40)
@given(data=st.data(), cost=serving_costs(), context=st.integers(0, 4096))
def test_believed_is_the_price_of_the_step_it_plans_on_random_costs(data, cost: ServingCost, context: int) -> None:
    k = data.draw(st.integers(1, cost.width - 1))
    _check_believed(cost, k, context, data.draw(st.integers(1, cost.max_requests)))


@pytest.mark.parametrize("name", SHIPPED, ids=_id)
@settings(max_examples=15)
@given(k=st.integers(1, 3), context=st.integers(1, 4096), b=st.integers(1, 256))
def test_believed_is_the_price_of_the_step_it_plans_on_every_shipped_file(name: str, k: int, context: int,
                                                                          b: int) -> None:
    _check_believed(_shipped(name), k, context, b)


def test_believed_at_a_longer_context_and_a_deeper_draft_costs_more() -> None:
    cost = _shipped("h100-llama8b-fitted")
    near, far = cost.believed(2, 100), cost.believed(2, 1000)
    assert far.step_seconds(16, 48) - near.step_seconds(16, 48) == pytest.approx(0.039e-6 * 900 * 16, rel=1e-9)
    assert cost.believed(3, 100).step_seconds(16, 48) - near.step_seconds(16, 48) == pytest.approx(
        0.84e-6 * 16, rel=1e-9)
    assert cost.believed_plain(1000)(16) - cost.believed_plain(100)(16) == pytest.approx(0.039e-6 * 900 * 16,
                                                                                          rel=1e-9)


# ---- what no price should accept ----

@pytest.mark.parametrize(("call", "names"), [
    (lambda c: c.price(StepWork(2, 4, -1000, drafts=1, drafting=2)), ("kv_tokens", "-1000")),
    (lambda c: c.price(StepWork(2, 4, 0, prefill_tokens=-5)), ("prefill_tokens", "-5")),
    (lambda c: c.price(StepWork(2, 4, 0, drafts=1, drafting=3)), ("drafting", "3")),
    (lambda c: c.price(StepWork(2, 1, 0, drafts=1, drafting=2)), ("rows", "1")),
    (lambda c: c.believed(4, 10.0), ("drafts", "4")),
    (lambda c: c.believed(0, 10.0), ("drafts", "0")),
    (lambda c: c.draft_seconds(2, 1.5), ("drafts", "1.5")),
    (lambda c: c.price(StepWork(2, 9, 0, drafts=3, drafting=2)), ("rows", "9")),
    (lambda c: c.price(StepWork(2, 3, 0)), ("rows", "3")),
    (lambda c: c.price(StepWork(2, 2, 10, kv_longest=4)), ("kv_longest", "[5, 10]", "4")),
    (lambda c: c.price(StepWork(2, 2, 10, kv_longest=11)), ("kv_longest", "11")),
    (lambda c: c.price(StepWork(2, 2, 10, catch_up=3)), ("catch_up", "3")),
    (lambda c: c.price(StepWork(2, 4, 10, drafts=1, drafting=2, catch_up=-1)), ("catch_up", "-1")),
    (lambda c: dataclasses.replace(c, kv_layout="dense"), ("kv_layout", "dense")),
])
def test_work_a_step_cannot_do_is_refused_naming_the_value(call, names) -> None:
    cost = h100_llama8b_fitted(max_requests=4)
    with pytest.raises(ValueError) as err:
        call(cost)
    assert all(n in str(err.value) for n in names)


def test_a_prefill_folded_that_is_not_a_bool_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match="prefill_folded must be a bool, got int: 1"):
        StepWork(2, 2, 10, prefill_tokens=5, prefill_folded=1)
