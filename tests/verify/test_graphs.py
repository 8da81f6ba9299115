"""TierGraphRunner over the engine's verify step (`VerifyStep`: the tiny random Llama of the engine tests
through transformers' own model code over a paged KV cache): tier choice, replay equals eager, padding
never writes the KV cache, eager fallback, manifests, the backend contract."""
import functools
import json
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark import RaggedVerifyLayout, TierGraphRunner, TierManifest, TierSpec
from dspark.lab.sweep import SweepCache, VerifyStepAdapter
from dspark.models.paged_attend import PagedAttend
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve.attention import batch_attention
from dspark.serve.tier_step import VerifyStepShape
from dspark.verify.graphs import CudaGraphBackend, EagerBackend
from dspark.verify.layout import split_rows
from tests.engine_models import VOCAB, tiny_llama

TIERS = (4, 8, 16)
W = 4
SLOTS = 8  # 5 requests + 2 ghost slots hold any padding of these tiers, with one to spare
CONTEXT, PAGE = 6, 4  # cached tokens per request at most, KV page size
MAX_REQUESTS = 8  # eager steps past the largest tier reach 5 requests x 4 rows; the slot test 8 requests


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def tiny_target(device: torch.device) -> TransformersCausalLM:
    return TransformersCausalLM(tiny_llama(max_seq_len=64)).to(device)


def make_runner(device, tiers=TIERS, slots=SLOTS, backend=None):
    """(the verify step's adapter: its cache, step and runner; the captured runner)."""
    step = VerifyStepAdapter(tiny_target(device), VerifyStepShape(tiers, W, MAX_REQUESTS, slots),
                             SweepCache(CONTEXT, PAGE, seed=3), device=device, backend=backend, name="toy")
    return step, step.runner


def inputs(layout, seed, device):
    """(tokens [total_rows], prefix_lens [B]) of one step: random ids over random cached context lengths."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, CONTEXT + 1, (layout.num_requests,), generator=gen)
    return torch.randint(0, VOCAB, (layout.total_rows,), generator=gen).to(device), prefix


def run(step, layout, tokens, prefix):
    """The step's logits of the real rows, through the runner (replay, or eager past the tiers)."""
    return step.verify(tokens, layout, prefix, step.cache.block_table[: layout.num_requests]).logits


def eager_reference(step, lens, tokens, prefix, k_cache, v_cache):
    """The same forward on the unpadded layout (no tiers, no runner), planned by `PagedAttend` over copies of
    the cache taken before the step."""
    device = tokens.device
    lay = RaggedVerifyLayout.from_verify_lens(torch.tensor(lens, dtype=torch.int32, device=device), width=W)
    target = step.target
    attn = batch_attention(step.cache, target.geometry, lay.total_rows, lay.num_slots)
    attend = PagedAttend(attn, k_cache.clone(), v_cache.clone(), lay, prefix, step.cache.block_table[: len(lens)])
    return target.logits(target(tokens, attend.positions, attend))


def written_slots(step, layout, prefix):
    """Flat KV slots `page * page_size + offset` the real rows of a step must write."""
    table = step.cache.block_table.cpu()
    req = layout.row_slot[: layout.total_rows].cpu().long()
    pos = layout.positions(prefix.to(layout.row_slot.device))[: layout.total_rows].cpu()
    return {int(table[r, p // PAGE]) * PAGE + int(p % PAGE) for r, p in zip(req, pos)}


def changed_slots(before, after):
    return set((before != after).any(dim=(0, 3, 4)).flatten().nonzero().flatten().tolist())


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
    step, runner = make_runner(device)
    b = data.draw(st.integers(1, SLOTS - 1))
    lens = data.draw(st.lists(st.integers(1, W), min_size=b, max_size=b).filter(lambda v: sum(v) <= 16))
    lay = runner.layout(lens)
    tokens, prefix = inputs(lay, seed, device)
    before_k, before_v = step.cache.k.clone(), step.cache.v.clone()
    want = eager_reference(step, lens, tokens, prefix, before_k, before_v)
    # poison the static buffers: stale rows from an earlier, larger step must not leak
    runner._buffers[lay.tier].rows["tokens"].fill_(VOCAB - 1)
    runner._buffers[lay.tier].rows["positions"].fill_(CONTEXT + W - 1)
    got = run(step, lay, tokens, prefix)
    runner.synchronize()
    assert got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    written = written_slots(step, lay, prefix)  # real rows write exactly their own slots; padding rows none
    assert changed_slots(before_k, step.cache.k) == written == changed_slots(before_v, step.cache.v)
    assert runner.replays[lay.tier] == 1 and runner.eager_steps == 0


def test_two_layouts_of_one_tier_in_a_row(device):
    step, runner = make_runner(device)
    outs = []
    for seed, lens in ((1, [4, 4, 3]), (2, [1, 2, 1, 3, 2])):
        lay = runner.layout(lens)
        assert lay.tier == 16
        tokens, prefix = inputs(lay, seed, device)
        want = eager_reference(step, lens, tokens, prefix, step.cache.k, step.cache.v)
        outs.append((run(step, lay, tokens, prefix).clone(), want))
    for got, want in outs:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert runner.replays[16] == 2


@pytest.mark.cuda
def test_cuda_graph_replay_two_layouts_equal_eager(device):
    _, runner = make_runner(device)
    assert isinstance(runner.backend, CudaGraphBackend)
    test_two_layouts_of_one_tier_in_a_row(device)


def test_eager_fallback_past_largest_tier_and_slots(device, caplog):
    step, runner = make_runner(device)
    caplog.set_level(logging.INFO, logger="dspark.verify.graphs")
    big = [4, 4, 4, 4, 2]  # 18 rows > largest tier 16
    lay = runner.layout(big)
    assert lay.tier is None and "largest captured tier 16" in lay.eager_reason
    tokens, prefix = inputs(lay, 0, device)
    want = eager_reference(step, big, tokens, prefix, step.cache.k, step.cache.v)
    torch.testing.assert_close(run(step, lay, tokens, prefix), want)
    assert runner.eager_steps == 1 and "largest captured tier 16" in caplog.text
    many = [1] * SLOTS  # 8 requests, 8 rows -> tier 8 exactly, no padding: replayed
    assert runner.layout(many).tier == 8
    many = [1] * (SLOTS - 1) + [2]  # 9 rows -> tier 16: 7 padding rows need 2 ghost slots, none left
    lay = runner.layout(many)
    assert lay.tier is None and "exceed the 8 slots captured for tier 16" in lay.eager_reason
    run(step, lay, *inputs(lay, 1, device))
    assert runner.eager_steps == 2 and sum(runner.replays.values()) == 0


def test_per_tier_slots_and_exactly_full_tier(device):
    _, runner = make_runner(device, slots=(2, 3, 5))
    assert runner.layout([4, 4, 4, 4]).tier == 16  # 4 requests fill tier 16 exactly: no ghost slot needed
    assert "exceed the 3 slots captured for tier 8" in runner.layout([1] * 6).eager_reason
    lay = runner.layout([4, 4])
    assert lay.tier == 8 and lay.num_slots == 3 and lay.num_padding_rows == 0


def test_run_rejects_foreign_layouts(device):
    _, runner = make_runner(device)
    lay = runner.layout([2, 2])
    tokens, prefix = inputs(lay, 0, device)
    rows = {"tokens": tokens, "positions": lay.positions(prefix.to(device))}
    with pytest.raises(ValueError, match="built without tiers"):
        runner.run(RaggedVerifyLayout.from_verify_lens([2, 2], width=W), **rows)
    with pytest.raises(ValueError, match="tier 12 is not a captured tier"):
        runner.run(RaggedVerifyLayout.from_verify_lens([2, 2], tiers=[12], graph_slots=SLOTS, width=W), **rows)
    with pytest.raises(ValueError, match="captured with 8"):
        runner.run(RaggedVerifyLayout.from_verify_lens([2, 2], tiers=TIERS, graph_slots=3, width=W), **rows)
    with pytest.raises(ValueError, match="row inputs must be exactly"):
        runner.run(lay, tokens=tokens)
    with pytest.raises(ValueError, match="row input 'tokens'"):
        runner.run(lay, tokens=tokens[:2], positions=rows["positions"])
    with pytest.raises(TypeError, match="must be torch.int64"):
        runner.run(lay, tokens=tokens, positions=rows["positions"].int())
    with pytest.raises(TypeError, match="must hold ints"):
        runner.layout([2.0, 2])


@pytest.mark.cpu_only(reason="host-side validation and arithmetic: no tensors")
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


@pytest.mark.cpu_only(reason="host-side validation and arithmetic: no tensors")
def test_split_rows():
    assert split_rows(3, 7, 4) == [3, 2, 2]
    assert split_rows(1, 1, 4) == [1]
    with pytest.raises(ValueError, match="rows=13"):
        split_rows(3, 13, 4)


@pytest.mark.cpu_only(reason="graph backend choice by device type, against a fake NPU backend")
def test_backend_selection_per_device_type(monkeypatch):
    import types

    from dspark.verify import graphs

    assert isinstance(graphs.default_backend(torch.device("cpu")), EagerBackend)
    with pytest.raises(ValueError, match="needs a cuda device"):
        CudaGraphBackend(torch.device("cpu"))
    npu = types.SimpleNamespace(type="npu")  # torch.device("npu") exists only once torch_npu is imported
    monkeypatch.setattr(graphs, "GRAPH_BACKENDS", {"cuda": CudaGraphBackend})
    with pytest.raises(ValueError, match="'npu'.*import dspark.ascend"):
        graphs.default_backend(npu)

    class NpuGraphBackend:
        name = "npu"

        def __init__(self, device):
            self.device = device

    graphs.register_graph_backend("npu", NpuGraphBackend)
    backend = graphs.default_backend(npu)
    assert isinstance(backend, NpuGraphBackend) and backend.device is npu


def test_backend_protocol_contract(device):
    """Largest tier first, one pool for all, update (the buffer refresh) runs before the graph replays; the
    prepare hook (host work: the attention's plan) sees each tier's idle layout before its capture and the live
    layout inside update, before the step runs."""
    events = []

    class Recording(EagerBackend):
        name = "recording"

        def new_pool(self):
            events.append("pool")
            return "the-pool"

        def capture(self, fn, pool):  # a graph backend's capture runs the step once
            events.append(("capture", pool))
            fn()
            return fn

        def replay(self, graph, update=None):
            events.append("replay")
            super().replay(graph, update)

    seen_rows = []

    def step(bufs):
        seen_rows.append((bufs.num_tokens, bufs.rows["x"][:, 0].tolist()))
        events.append("step")
        return bufs.rows["x"] * 2

    def prepare(layout):
        events.append(("prepare", layout.tier, layout.num_requests))

    runner = TierGraphRunner(step, TierSpec(TIERS, SLOTS, W), device, Recording(),
                             row_inputs={"x": ((1,), torch.float32)}, prepare=prepare)
    runner.capture()
    assert events == ["pool"] + [e for t in (16, 8, 4) for e in (("prepare", t, 0), ("capture", "the-pool"), "step")]
    assert [n for n, _ in seen_rows] == [16, 8, 4]  # largest first
    lay = runner.layout([2, 1])
    out = runner.run(lay, x=torch.tensor([[1.0], [2.0], [3.0]], device=device))
    assert events[-3:] == ["replay", ("prepare", 4, 2), "step"]
    assert seen_rows[-1] == (4, [1.0, 2.0, 3.0, 0.0])  # refreshed, padding zeroed
    assert out.tolist() == [[2.0], [4.0], [6.0]]
    big = runner.layout([4, 4, 4, 4, 1])  # eager past the largest tier: prepared too
    runner.run(big, x=torch.ones(17, 1, device=device))
    assert events[-2:] == [("prepare", None, 5), "step"]


def test_eager_capture_runs_no_step(device):
    """The eager backend captures nothing: building the runner runs no step (on the CPU a tier ladder's
    forwards cost seconds per batch size), and each run runs the step once at its tier's padded shape."""
    calls = []

    def step(bufs):
        calls.append(bufs.num_tokens)
        return bufs.rows["x"] * 3

    runner = TierGraphRunner(step, TierSpec(TIERS, SLOTS, W), device, EagerBackend(),
                             row_inputs={"x": ((1,), torch.float32)}).capture()
    assert runner.captured and calls == []
    out = runner.run(runner.layout([2, 1]), x=torch.tensor([[1.0], [-2.0], [0.5]], device=device))
    assert calls == [4] and out.tolist() == [[3.0], [-6.0], [1.5]]


@pytest.mark.parametrize("static", [False, True])
def test_runner_keeps_outputs_only_for_static_backends(device, static):
    """An eager backend's outputs are fresh tensors per step: once the caller drops them (and after the
    capture) the runner holds none, so idle tiers keep no memory. A static-output backend (graphs) writes every
    replay of a tier into the tensors its capture returned, so the runner keeps them and two replays alias."""
    import gc
    import weakref

    class Backend(EagerBackend):
        static_outputs = static

        def capture(self, fn, pool):  # a graph backend's capture runs the step once
            fn()
            return fn

    def step(bufs):
        out = bufs.rows["x"] * 2
        made.append(weakref.ref(out))
        return kept.setdefault(bufs.num_tokens, out).copy_(out) if static else out

    kept: dict[int, torch.Tensor] = {}
    made: list[weakref.ref] = []
    runner = TierGraphRunner(step, TierSpec(TIERS, SLOTS, W), device, Backend(),
                             row_inputs={"x": ((1,), torch.float32)})
    runner.capture()
    gc.collect()
    assert len(made) == len(TIERS) and all((r() is None) != static for r in made)  # the captures' outputs
    x = torch.tensor([[1.5], [-2.0], [3.0]], device=device)
    out = runner.run(runner.layout([2, 1]), x=x)
    again = runner.run(runner.layout([1, 2]), x=-x)
    assert out.tolist() == ([[-3.0], [4.0], [-6.0]] if static else [[3.0], [-4.0], [6.0]])
    assert again.tolist() == [[-3.0], [4.0], [-6.0]]
    assert (out.data_ptr() == again.data_ptr()) == static
    base = weakref.ref(again._base if again._base is not None else again)
    del out, again
    gc.collect()
    assert (base() is not None) == static


def test_runner_layout_is_built_on_the_host_and_moved_once(device):
    """`runner.layout` of host lengths reads nothing from the device (on `meta` a read raises): the layout is
    built on the host, moved in one copy, and keeps its host copy for the attention's plan."""
    meta = torch.device("meta")
    runner = TierGraphRunner(lambda bufs: bufs.rows["x"], TierSpec(TIERS, SLOTS, W), "cpu", EagerBackend(),
                             row_inputs={"x": ((), torch.int64)})
    runner.device = meta  # (a manifest records no meta platform; the layout needs only the device)
    for lens, tier in (([2, 3, 1], 8), ([4] * 5, None)):
        layout = runner.layout(lens)
        want = RaggedVerifyLayout.from_verify_lens(torch.tensor(lens, dtype=torch.int32), TIERS,
                                                   graph_slots=SLOTS if tier else None, width=W)
        assert layout.tier == tier and layout.verify_lens.device == meta and layout.host is not None
        for name in ("verify_lens", "slot_lens", "seqused", "row_slot", "row_within", "slot_qo_indptr"):
            assert torch.equal(getattr(layout.host, name), getattr(want, name)), name
            assert getattr(layout, name).shape == getattr(want, name).shape, name
