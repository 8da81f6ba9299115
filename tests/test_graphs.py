import json
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark import RaggedVerifyLayout, TierGraphRunner, TierManifest
from dspark.engine.blockstep import BlockVerifyStep, split_rows
from dspark.verify.graphs import CudaGraphBackend, EagerBackend, StepBuffers

TIERS = (4, 8, 16)
W = 4
SLOTS = 8  # 5 requests + 2 ghost slots hold any padding of these tiers, with one to spare


pytestmark = pytest.mark.usefixtures("one_thread")


def make_runner(device, tiers=TIERS, slots=SLOTS, backend=None):
    model = BlockVerifyStep(width=W, num_slots=10,
                            max_context=6, hidden=16, heads=2, vocab=11, device=device, seed=3)
    runner = TierGraphRunner(model, tiers, slots, device, backend, width=W, row_inputs=model.row_inputs,
                             model_id="toy")
    return model, runner.capture()


def inputs(layout, model, seed, device):
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, model.max_context + 1, (layout.num_requests,), generator=gen)
    hidden = torch.randn(layout.total_rows, model.hidden, generator=gen).to(device)
    return {"hidden": hidden, "positions": layout.positions(prefix.to(device))[: layout.total_rows]}


def eager_reference(model, lens, rows, device):
    """The same step run directly on the unpadded layout (no tiers, no runner)."""
    lay = RaggedVerifyLayout.from_verify_lens(torch.tensor(lens, dtype=torch.int32, device=device), width=W)
    bufs = StepBuffers(rows=rows, slot_lens=lay.slot_lens, seqused=lay.seqused,
                       slot_qo_indptr=lay.slot_qo_indptr, row_slot=lay.row_slot, row_within=lay.row_within)
    return model(bufs)


@pytest.mark.parametrize("lens, tier", [([1], 4), ([4], 4), ([2, 3], 8), ([4, 4], 8), ([4, 4, 1], 16),
                                        ([4, 4, 4, 4], 16)])
def test_tier_selection_and_padding(lens, tier, device):
    _, runner = make_runner(device)
    lay = runner.layout(lens)
    assert (lay.tier, lay.graph_num_tokens, lay.num_slots) == (tier, tier, SLOTS)
    assert lay.num_padding_rows == tier - sum(lens)
    assert lay.seqused[len(lens):].eq(0).all() and lay.seqused[: len(lens)].tolist() == lens


@settings(max_examples=12)
@given(seed=st.integers(0, 10_000), data=st.data())
def test_replay_equals_eager_and_padding_never_writes_kv(seed, data, device):
    model, runner = make_runner(device)
    b = data.draw(st.integers(1, SLOTS - 1))
    lens = data.draw(st.lists(st.integers(1, W), min_size=b, max_size=b).filter(lambda v: sum(v) <= 16))
    lay = runner.layout(lens)
    rows = inputs(lay, model, seed, device)
    want = eager_reference(model, lens, rows, device)
    before_k = model.cache_k.clone()
    # poison the static buffers: stale rows from an earlier, larger step must not leak
    runner._buffers[lay.tier].rows["hidden"].fill_(float("nan"))
    got = runner.run(lay, **rows)
    runner.synchronize()
    assert got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    changed = (model.cache_k != before_k).any(dim=1).nonzero().flatten().tolist()
    pos = rows["positions"].cpu()
    written = {int(model.capacity * s + p) for s, p in zip(lay.row_slot[: lay.total_rows].tolist(), pos.tolist())}
    assert set(changed) <= written | {model.dummy_row}
    assert runner.replays[lay.tier] == 1 and runner.eager_steps == 0


def test_two_layouts_of_one_tier_in_a_row(device):
    model, runner = make_runner(device)
    outs = []
    for seed, lens in ((1, [4, 4, 3]), (2, [1, 2, 1, 3, 2])):
        lay = runner.layout(lens)
        assert lay.tier == 16
        rows = inputs(lay, model, seed, device)
        outs.append((runner.run(lay, **rows).clone(), eager_reference(model, lens, rows, device)))
    for got, want in outs:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_cuda_graph_replay_two_layouts_equal_eager(device):
    model, runner = make_runner(device)
    assert isinstance(runner.backend, CudaGraphBackend)
    test_two_layouts_of_one_tier_in_a_row(device)


def test_eager_fallback_past_largest_tier_and_slots(device, caplog):
    model, runner = make_runner(device)
    caplog.set_level(logging.INFO, logger="dspark.verify.graphs")
    big = [4, 4, 4, 4, 2]  # 18 rows > largest tier 16
    lay = runner.layout(big)
    assert lay.tier is None and "largest captured tier 16" in lay.eager_reason
    rows = inputs(lay, model, 0, device)
    torch.testing.assert_close(runner.run(lay, **rows), eager_reference(model, big, rows, device))
    assert runner.eager_steps == 1 and "largest captured tier 16" in caplog.text
    many = [1] * SLOTS  # 8 requests, 8 rows -> tier 8 exactly, no padding: replayed
    assert runner.layout(many).tier == 8
    many = [1] * (SLOTS - 1) + [2]  # 9 rows -> tier 16: 7 padding rows need 2 ghost slots, none left
    lay = runner.layout(many)
    assert lay.tier is None and "exceed the 8 slots captured for tier 16" in lay.eager_reason
    runner.run(lay, **inputs(lay, model, 1, device))
    assert runner.eager_steps == 2 and sum(runner.replays.values()) == 0


def test_per_tier_slots_and_exactly_full_tier(device):
    _, runner = make_runner(device, slots=(2, 3, 5))
    assert runner.layout([4, 4, 4, 4]).tier == 16  # 4 requests fill tier 16 exactly: no ghost slot needed
    assert "exceed the 3 slots captured for tier 8" in runner.layout([1] * 6).eager_reason
    lay = runner.layout([4, 4])
    assert lay.tier == 8 and lay.num_slots == 3 and lay.num_padding_rows == 0


def test_run_rejects_foreign_layouts(device):
    model, runner = make_runner(device)
    lay = runner.layout([2, 2])
    rows = inputs(lay, model, 0, device)
    with pytest.raises(ValueError, match="built without tiers"):
        runner.run(RaggedVerifyLayout.from_verify_lens([2, 2], width=W), **rows)
    with pytest.raises(ValueError, match="tier 12 is not a captured tier"):
        runner.run(RaggedVerifyLayout.from_verify_lens([2, 2], tiers=[12], slots=SLOTS, width=W), **rows)
    with pytest.raises(ValueError, match="captured with 8"):
        runner.run(RaggedVerifyLayout.from_verify_lens([2, 2], tiers=TIERS, slots=3, width=W), **rows)
    with pytest.raises(ValueError, match="row inputs must be exactly"):
        runner.run(lay, hidden=rows["hidden"])
    with pytest.raises(ValueError, match="row input 'hidden'"):
        runner.run(lay, hidden=rows["hidden"][:2], positions=rows["positions"])
    with pytest.raises(TypeError, match="must be torch.int64"):
        runner.run(lay, hidden=rows["hidden"], positions=rows["positions"].int())
    with pytest.raises(TypeError, match="must hold ints"):
        runner.layout([2.0, 2])


@pytest.mark.parametrize("kwargs, needle", [
    (dict(tiers=(8, 4)), "strictly increasing"),
    (dict(tiers=(4, 4)), "strictly increasing"),
    (dict(tiers=()), "at least one tier"),
    (dict(slots=(2, 2)), "one slot count per tier"),
    (dict(slots=(1, 1, 3)), "tier 8 cannot be filled"),
    (dict(platform="tpu"), "platform must be one of"),
    (dict(width=0), "width must be an int >= 1"),
])
def test_bad_manifests(kwargs, needle):
    base = dict(tiers=TIERS, slots=(8, 8, 8), width=W, platform="cpu", model_id="toy")
    with pytest.raises(ValueError, match=needle):
        TierManifest(**{**base, **kwargs})


def test_manifest_roundtrip_and_load_errors(tmp_path, device):
    _, runner = make_runner(device)
    path = runner.manifest.save(tmp_path / "toy.tiers.json")
    assert [p.name for p in tmp_path.iterdir()] == ["toy.tiers.json"]  # no temp file left behind
    back = TierManifest.load(path, width=W, platform=device.type, model_id="toy")
    assert back == runner.manifest and back.slots_for(8) == SLOTS
    with pytest.raises(ValueError, match="width=4, but this run has width=8"):
        TierManifest.load(path, width=8)
    with pytest.raises(ValueError, match="platform='npu'"):
        TierManifest.load(path, platform="npu")
    obj = json.loads(path.read_text())
    for mutate, needle in ((lambda o: o.update(tiers=[16, 8, 4]), "strictly increasing"),
                           (lambda o: o.pop("slots"), "lacks fields"),
                           (lambda o: o.update(version=99), "not a dspark.tier_manifest v1"),
                           (lambda o: o.update(tiers="4,8"), "must be lists")):
        bad = dict(obj)
        mutate(bad)
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=needle):
            TierManifest.load(tmp_path / "bad.json")
    (tmp_path / "corrupt.json").write_text('{"schema": "dspark.tier_ma')
    with pytest.raises(ValueError, match="corrupt.json is not valid JSON"):
        TierManifest.load(tmp_path / "corrupt.json")
    runner2 = TierGraphRunner.from_manifest(runner.step_fn, back, device, EagerBackend(),
                                            row_inputs=runner.row_inputs)
    assert runner2.tiers == TIERS and runner2.width == W


def test_split_rows():
    assert split_rows(3, 7, 4) == [3, 2, 2]
    assert split_rows(1, 1, 4) == [1]
    with pytest.raises(ValueError, match="rows=13"):
        split_rows(3, 13, 4)


def test_backend_selection_is_lazy_per_device_type(monkeypatch):
    import sys
    import types

    from dspark.verify.graphs import default_backend

    assert isinstance(default_backend(torch.device("cpu")), EagerBackend)
    with pytest.raises(ValueError, match="needs a cuda device"):
        CudaGraphBackend(torch.device("cpu"))
    fake = types.ModuleType("dspark.ascend.graphs")

    class NpuGraphBackend:
        name = "npu"

        def __init__(self, device):
            self.device = device

    fake.NpuGraphBackend = NpuGraphBackend
    monkeypatch.setitem(sys.modules, "dspark.ascend.graphs", fake)
    npu = types.SimpleNamespace(type="npu")  # torch.device("npu") exists only once torch_npu is imported
    backend = default_backend(npu)
    assert isinstance(backend, NpuGraphBackend) and backend.device is npu


def test_backend_protocol_contract(device):
    """Largest tier first, one pool for all, update (the buffer refresh) runs before the graph replays."""
    events = []

    class Recording(EagerBackend):
        name = "recording"

        def new_pool(self):
            events.append("pool")
            return "the-pool"

        def capture(self, fn, pool):
            events.append(("capture", pool))
            return super().capture(fn, pool)

        def replay(self, graph, update=None):
            events.append("replay")
            super().replay(graph, update)

    seen_rows = []

    def step(bufs):
        seen_rows.append((bufs.num_tokens, bufs.rows["x"][:, 0].tolist()))
        return bufs.rows["x"] * 2

    runner = TierGraphRunner(step, TIERS, SLOTS, device, Recording(), width=W,
                             row_inputs={"x": ((1,), torch.float32)})
    runner.capture()
    assert events == ["pool"] + [("capture", "the-pool")] * 3
    assert [n for n, _ in seen_rows] == [16, 8, 4]  # largest first
    lay = runner.layout([2, 1])
    out = runner.run(lay, x=torch.tensor([[1.0], [2.0], [3.0]], device=device))
    assert events[-1] == "replay" and seen_rows[-1] == (4, [1.0, 2.0, 3.0, 0.0])  # refreshed, padding zeroed
    assert out.tolist() == [[2.0], [4.0], [6.0]]
