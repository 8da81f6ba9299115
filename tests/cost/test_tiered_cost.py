import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dspark import (
    AdditiveCostModel,
    BatchTerm,
    CostModel,
    ProfileSample,
    ScheduleConfig,
    TieredCostModel,
    TierTerm,
    check_cost_model,
    choose_budget,
    load_cost_model,
)
from dspark.cost import serving_tiers, tier_edge_errors
from dspark.lab.sweep import dense_rows, tier_rows
from dspark.verify.layout import round_up_to_tier

TIERS = (8, 16, 24, 32, 48, 64)
W = 8
PHI = {8: 1.0e-3, 16: 1.3e-3, 24: 1.6e-3, 32: 1.9e-3, 48: 2.6e-3, 64: 3.3e-3}


def truth(b: int, m: int) -> float:
    return 2e-4 + 3e-5 * b + PHI[round_up_to_tier(m, TIERS)]


def samples(batches=(1, 2, 4, 8), rows_fn=tier_rows):
    pts = [(b, m) for b in batches for m in (rows_fn(TIERS, b, W) if rows_fn is tier_rows else rows_fn(b, W))]
    return [ProfileSample(b, m, truth(b, m)) for b, m in pts if m <= TIERS[-1]]


def test_fit_recovers_a_noise_free_staircase_and_lookup_uses_the_runtime_round_up():
    model, report = TieredCostModel.fit(samples(), tiers=TIERS, platform="cpu", width=W)
    assert report.rms < 1e-12 and report.r2 == pytest.approx(1.0)
    for b in (1, 2, 3, 5, 8):  # 3 and 5 are interpolated between batch probes (alpha is linear here)
        for m in range(b, min(b * W, 64) + 1):
            assert model.step_seconds(b, m) == pytest.approx(truth(b, m), rel=1e-9)
    rows = torch.arange(0, 70)
    got = model.step_seconds(4, rows)
    assert got.dtype == torch.float64 and got.shape == rows.shape
    assert torch.isinf(got[65:]).all() and torch.isfinite(got[:65]).all()
    edges = report.extras["tier_edge_error"]
    assert set(edges) == {str(t) for t in TIERS} and abs(edges["16"]["1"]) < 1e-9
    assert model.tier_of(17) == 24 and model.tier_of(65) is None


@given(tiers=st.lists(st.integers(1, 300), min_size=1, max_size=8, unique=True).map(sorted),
       rows=st.lists(st.integers(0, 320), min_size=1, max_size=20))
def test_tier_lookup_equals_layout_round_up(tiers, rows):
    model = TieredCostModel(1e-3, BatchTerm([1], [0.0]), TierTerm(tiers, [1e-4 * (i + 1) for i in range(len(tiers))]))
    got = model.step_seconds(1, torch.tensor(rows))
    for m, sec in zip(rows, got.tolist()):
        t = round_up_to_tier(m, tiers)
        assert (math.isinf(sec) if t is None else sec == pytest.approx(1e-3 + 1e-4 * (tiers.index(t) + 1)))
        assert model.tier_of(m) == t


def test_dense_table_fit_and_json_roundtrip(tmp_path):
    data = samples()
    data = [ProfileSample(s.num_requests, s.rows, s.seconds * (1.1 if s.num_requests == 8 and s.rows > 48 else 1.0))
            for s in data]
    model, report = TieredCostModel.fit(data, tiers=TIERS, dense=True, platform="cpu", width=W)
    assert model.table is not None and report.extras["dense"] is True
    assert model.step_seconds(8, 64) == pytest.approx(truth(8, 64) * 1.1)  # the cell median, not the additive fit
    assert model.step_seconds(1, 8) == pytest.approx(truth(1, 8))
    path = model.save(tmp_path / "tiered.json")
    back = load_cost_model(path)
    assert isinstance(back, TieredCostModel) and back == model
    assert back.step_seconds(8, 50) == model.step_seconds(8, 50)
    assert back.fit_report.extras["tier_edge_error"] == report.extras["tier_edge_error"]
    assert json.loads(path.read_text())["kind"] == "tiered"


def test_fit_rejects_bad_designs():
    with pytest.raises(ValueError, match="disconnected design"):
        # B=1 only ever meets tier 8, B=8 only tier 64: alpha and phi cannot be told apart
        TieredCostModel.fit([ProfileSample(1, 8, 1e-3), ProfileSample(1, 7, 1e-3), ProfileSample(8, 64, 2e-3),
                             ProfileSample(8, 60, 2e-3)], tiers=(8, 64))
    with pytest.raises(ValueError, match=r"tiers \[24\] have no samples"):
        TieredCostModel.fit([s for s in samples() if not 16 < s.rows <= 24], tiers=TIERS)
    with pytest.raises(ValueError, match=r"rows \[65\] lie past the largest tier 64"):
        TieredCostModel.fit(samples() + [ProfileSample(9, 65, 1e-2)], tiers=TIERS)
    with pytest.raises(ValueError, match="strictly increasing|sorted and unique"):
        TieredCostModel.fit(samples(), tiers=(16, 8))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(phi=[1e-3]), "one value per probe"),
    (dict(tiers=[16, 8]), "sorted and unique"),
    (dict(bias=-1.0), "at B=1, tier 8 is"),
    (dict(alpha=[0.0, -1.15e-3]), "at B=4, tier 8 is"),
    (dict(phi=[1e-3, float("nan")]), "finite"),
    (dict(table=[[1e-3, 2e-3]]), "one row per batch probe"),
    (dict(table=[[1e-3, 2e-3], [1e-3, -1.0]]), "at B=4, tier 16 is -1.0"),
    (dict(table=[[1e-3, 2e-3], [1e-3, float("inf")]]), "finite"),
])
def test_constructor_validation(kwargs, needle):
    d = {**dict(bias=1e-4, batch_probes=[1, 4], alpha=[0.0, 1e-5], tiers=[8, 16], phi=[1e-3, 2e-3]), **kwargs}
    with pytest.raises(ValueError, match=needle):
        TieredCostModel(d["bias"], BatchTerm(d["batch_probes"], d["alpha"]), TierTerm(d["tiers"], d["phi"]),
                        table=d.get("table"))


def test_unreachable_corners_may_be_non_positive():
    # with W=4, B <= 2 verifies at most 8 rows: probe B=1 (serving B in [1, 2)) never replays tier 64
    table = [[1e-3, 2e-3, -1.0], [1.1e-3, 2.1e-3, 4e-3], [1.2e-3, 2.2e-3, 5e-3]]
    terms = BatchTerm([1, 2, 16], [0.0, 1e-5, 5e-4]), TierTerm([4, 8, 64], [1e-3, 2e-3, 4e-3])
    model = TieredCostModel(1e-4, *terms, table=table, width=4)
    assert model.step_seconds(16, 60) == pytest.approx(5e-3) and model.step_seconds(2, 8) == pytest.approx(2.1e-3)
    with pytest.raises(ValueError, match="at B=1, tier 64 is -1.0"):  # W=8: B=2 reaches 16 rows -> tier 64
        TieredCostModel(1e-4, *terms, table=table, width=8)


def test_load_refuses_corrupt_or_foreign_tables(tmp_path):
    model, _ = TieredCostModel.fit(samples(), tiers=TIERS, platform="cuda", width=W)
    path = model.save(tmp_path / "t.json")
    check_cost_model(load_cost_model(path), width=W, platform="cuda")
    with pytest.raises(ValueError, match="profiled for W=8, this run has W=5"):
        check_cost_model(load_cost_model(path), width=5)
    with pytest.raises(ValueError, match="platform 'cuda', this run is on 'npu'"):
        check_cost_model(load_cost_model(path), platform="npu")
    (tmp_path / "bad.json").write_text(path.read_text()[:50])
    with pytest.raises(ValueError, match="not valid JSON"):
        load_cost_model(tmp_path / "bad.json")
    d = json.loads(path.read_text())
    d["tiers"] = d["tiers"][::-1]
    (tmp_path / "unsorted.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="sorted and unique"):
        CostModel.load(tmp_path / "unsorted.json")
    del d["phi"]
    (tmp_path / "nophi.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="missing field 'phi'"):
        CostModel.load(tmp_path / "nophi.json")


def test_choose_budget_accepts_it_and_lands_on_a_tier_top():
    model, _ = TieredCostModel.fit(samples(), tiers=TIERS, width=W)
    cfg = ScheduleConfig(gamma=W - 1)
    gen = torch.Generator().manual_seed(0)
    for b in (1, 3, 4, 7):
        surv = torch.rand(b, W - 1, generator=gen).sort(dim=1, descending=True).values.clamp(min=0.05)
        dec = choose_budget(surv, cost_model=model, cfg=cfg)
        n_cand = b * (W - 1)
        assert dec.rows in TIERS or dec.budget == n_cand, (b, dec.rows)
        best = max(range(n_cand + 1), key=lambda k: (float(dec.tau_curve[k]) / truth(b, b + k), -k))
        assert dec.budget == best


def test_edge_errors_show_a_smooth_fit_missing_the_cliff():
    data = samples(rows_fn=dense_rows)
    additive, _ = AdditiveCostModel.fit(data, row_bin=64)
    tiered, _ = TieredCostModel.fit(data, tiers=TIERS)
    smooth, exact = tier_edge_errors(additive, data, TIERS), tier_edge_errors(tiered, data, TIERS)
    worst = max(abs(e) for per in smooth.values() for e in per.values())
    assert worst > 0.05 and max(abs(e) for per in exact.values() for e in per.values()) < 1e-9


@given(b=st.integers(0, 12), first=st.integers(0, 80), count=st.integers(0, 40), dense=st.booleans())
def test_seconds_curve_is_step_seconds_past_the_largest_tier_too(b, first, count, dense):
    """The per-B row table the budget curve reads: equal to step_seconds at every row, +inf past the top."""
    model, _ = TieredCostModel.fit(samples(), tiers=TIERS, dense=dense, platform="cpu", width=W)
    curve = model.seconds_curve(b, first, count)
    rows = torch.arange(first, first + count, dtype=torch.float64)
    assert curve.tolist() == model.step_seconds(b, rows).tolist()
    assert all(math.isinf(v) == (m > TIERS[-1]) for v, m in zip(curve.tolist(), rows.tolist()))


@st.composite
def tier_profiles(draw):
    """Tiers, one measured step time per (B, tier) cell that was profiled (rows anywhere in the tier), a
    sample past the largest tier (an eager step), and a margin."""
    tiers = tuple(sorted(draw(st.lists(st.integers(1, 64), min_size=1, max_size=7, unique=True))))
    cells = {}
    for b in draw(st.lists(st.sampled_from((1, 2, 4, 8)), min_size=1, max_size=4, unique=True)):
        for i, t in enumerate(tiers):
            if t >= b and draw(st.booleans()):  # B requests verify >= B rows
                rows = draw(st.integers(max(tiers[i - 1] + 1 if i else 1, b), t))
                cells[(b, t)] = (rows, draw(st.floats(0.01, 1.0)))
    if not cells:
        cells[(1, tiers[-1])] = (tiers[-1], 0.5)
    out = [ProfileSample(b, rows, sec) for (b, _), (rows, sec) in cells.items()]
    out.append(ProfileSample(1, tiers[-1] + 1, 1e-6))  # eager: ignored however cheap
    return tiers, cells, out, draw(st.floats(0.0, 0.3))


@given(tier_profiles())
def test_serving_tiers_leave_out_exactly_the_tiers_a_larger_one_beats_at_every_batch_size(profile):
    tiers, cells, profiled, margin = profile
    served = serving_tiers(profiled, tiers, margin)
    assert served[-1] == tiers[-1] and list(served) == [t for t in tiers if t in served]

    def beaten_at(b, t, among):  # a larger tier in `among` measured at b runs >= margin faster than t
        return any(u > t and (b, u) in cells and cells[(b, u)][1] <= (1 - margin) * cells[(b, t)][1] for u in among)

    for t in tiers[:-1]:
        at = [b for (b, u) in cells if u == t]
        if t in served:  # kept: never measured, or some batch size where no larger tier beats it
            assert not at or any(not beaten_at(b, t, tiers) for b in at)
        else:  # left out: at every batch size that measured it, a tier that *is* served beats it
            assert at and all(beaten_at(b, t, served) for b in at)


def test_serving_tiers_keep_a_monotone_profile_and_drop_a_slower_tier():
    monotone = [ProfileSample(4, t, 0.1 + 0.01 * t) for t in (4, 8, 12, 16)]
    assert serving_tiers(monotone, (4, 8, 12, 16)) == (4, 8, 12, 16)
    dip = [ProfileSample(4, 4, 0.15), ProfileSample(4, 8, 0.19), ProfileSample(4, 12, 0.23), ProfileSample(4, 16, 0.20)]
    assert serving_tiers(dip, (4, 8, 12, 16)) == (4, 8, 16)  # 16 rows ran 13 % faster than 12
    assert serving_tiers(dip, (4, 8, 12, 16), margin=0.2) == (4, 8, 12, 16)  # within the margin: noise
    for bad in (-0.1, 1.0, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="margin"):
            serving_tiers(dip, (4, 8, 12, 16), bad)
