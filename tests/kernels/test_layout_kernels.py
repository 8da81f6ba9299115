"""Layout Triton kernels == their torch references (interpreter on the CPU), under both launch policies."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark import RaggedVerifyLayout
from dspark.kernels import dispatch
from dspark.kernels import layout as k

POLICIES = [("work", None), ("cores", 3)]


def _lens(b: int, w: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, w + 1, (b,), generator=gen, dtype=torch.int32).to(device)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("b", [0, 1, 7, 1025, 3001])
def test_qo_indptr_any_batch(b, policy, device):
    lens = _lens(b, 16, b, device)
    out = torch.full((b + 1,), -123, dtype=torch.int32, device=device)
    with dispatch.launch_policy(*policy):
        got = k.qo_indptr_triton(lens, out)
    assert torch.equal(got, k.qo_indptr_ref(lens))


@pytest.mark.parametrize("policy", POLICIES)
@given(b=st.integers(0, 40), w=st.integers(1, 9), extra=st.integers(0, 20), seed=st.integers(0, 10**6))
@settings(max_examples=12)
def test_row_maps(policy, b, w, extra, seed, device):
    # real slots, then ghost slots: empty ones and a long one written in several blocks
    ghosts = torch.tensor([extra, 0, 2 * extra + 1], dtype=torch.int32, device=device)
    slot_lens = torch.cat([_lens(b, w, seed, device), ghosts])
    rows = int(slot_lens.sum())
    poison = lambda: torch.full((rows,), -77, dtype=torch.int32, device=device)  # noqa: E731
    with dispatch.launch_policy(*policy):
        got = k.row_maps_triton(slot_lens, poison(), poison())
    ref = k.row_maps_ref(slot_lens, rows)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@given(b=st.integers(0, 40), w=st.integers(1, 9), extra=st.integers(0, 20), seed=st.integers(0, 10**6))
@settings(max_examples=25)
def test_slot_maps_host(b, w, extra, seed, device):
    slot_lens = torch.cat([_lens(b, w, seed, torch.device("cpu")), torch.tensor([extra, 0, 2 * extra + 1],
                                                                                 dtype=torch.int32)])
    rows = int(slot_lens.sum())
    indptr, row_slot, row_within = map(torch.from_numpy, k.slot_maps_host(slot_lens.numpy(), rows))
    ref_slot, ref_within = (t.cpu() for t in k.row_maps_ref(slot_lens.to(device), rows))
    assert torch.equal(indptr, k.qo_indptr_ref(slot_lens.to(device)).cpu())
    assert torch.equal(row_slot, ref_slot) and torch.equal(row_within, ref_within)


@given(lens=st.lists(st.integers(1, 7), min_size=0, max_size=30), tier_extra=st.integers(0, 12),
       slots_extra=st.integers(1, 4))
@settings(max_examples=25)
def test_layout_host_path_equals_torch_path(lens, tier_extra, slots_extra, device):
    """The numpy host build a runner or planner chooses (`host=True`) equals the public torch build on the device
    field by field."""
    vl = torch.tensor(lens, dtype=torch.int32)
    tiers = [sum(lens) + tier_extra] if lens else None
    kw = dict(tiers=tiers, graph_slots=len(lens) + slots_extra + tier_extra, width=7)
    torch_path = RaggedVerifyLayout.from_verify_lens(vl.to(device), **kw).to("cpu")
    host_path = RaggedVerifyLayout._from_lens(vl, tuple(tiers or ()), kw["graph_slots"], 7, total_rows=sum(lens),
                                              host=True)
    for name in ("verify_lens", "qo_indptr", "slot_lens", "slot_qo_indptr", "seqused", "row_slot", "row_within"):
        a, b = getattr(host_path, name), getattr(torch_path, name)
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), name
    for name in ("width", "total_rows", "graph_num_tokens", "tier", "eager_reason"):
        assert getattr(host_path, name) == getattr(torch_path, name), name


def test_row_maps_many_slots(device):
    slot_lens = _lens(3001, 4, 3, device)
    rows = int(slot_lens.sum())
    poison = lambda: torch.full((rows,), -77, dtype=torch.int32, device=device)  # noqa: E731
    with dispatch.launch_policy("cores", 3):
        got = k.row_maps_triton(slot_lens, poison(), poison())
    ref = k.row_maps_ref(slot_lens, rows)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.bool]


def _values(shape, dtype, gen):
    x = torch.randn(shape, generator=gen) * 100
    return x > 0 if dtype == torch.bool else x.to(dtype)


@pytest.mark.parametrize("policy", POLICIES)
@given(b=st.integers(0, 12), w=st.integers(1, 6), extra=st.integers(0, 7), seed=st.integers(0, 10**6),
       tail=st.sampled_from([(), (1,), (5,), (3, 7), (1030,)]), dtype=st.sampled_from(DTYPES))
@settings(max_examples=10)
def test_pack_and_scatter(policy, b, w, extra, seed, tail, dtype, device):
    gen = torch.Generator().manual_seed(seed)
    vl = _lens(b, w, seed, device)
    total = int(vl.sum())
    lay = RaggedVerifyLayout.from_verify_lens(vl, tiers=[max(total + extra, 1)], graph_slots=b + 1 + extra, width=w)
    strided = _values((b, w, *tail), dtype, gen).to(device)
    fill = 1 if dtype == torch.bool else -5
    poison_value = 0 if dtype == torch.bool else 77
    packed_out = torch.full((lay.graph_num_tokens, *tail), poison_value, dtype=dtype, device=device)
    scattered_out = torch.full((b, w, *tail), poison_value, dtype=dtype, device=device)
    with dispatch.launch_policy(*policy):
        packed = k.pack_triton(strided, lay.row_slot, lay.row_within, lay.total_rows, fill, packed_out)
        back = k.scatter_triton(packed, lay.qo_indptr, w, fill, scattered_out)
    assert torch.equal(packed, k.pack_ref(strided, lay.row_slot, lay.row_within, lay.total_rows, fill))
    assert torch.equal(back, k.scatter_ref(packed, lay.qo_indptr, w, lay.total_rows, fill))


def test_pack_non_contiguous_source_and_nan(device):
    lay = RaggedVerifyLayout.from_verify_lens([3, 1, 2], tiers=[8], width=3).to(device)
    base = torch.randn(3, 5, 4, device=device)
    base[1, 2] = float("nan")
    strided = base[:, 1:4]  # a view with row stride 4 * 5
    out = torch.full((8, 4), 9.0, device=device)
    got = k.pack_triton(strided, lay.row_slot, lay.row_within, lay.total_rows, float("nan"), out)
    ref = k.pack_ref(strided, lay.row_slot, lay.row_within, lay.total_rows, float("nan"))
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(got.nan_to_num(-1.0), ref.nan_to_num(-1.0))


def test_dispatch_uses_kernels(triton_backend, device):
    lay = RaggedVerifyLayout.from_verify_lens(torch.tensor([2, 4, 1], device=device), tiers=[9], width=4)
    ref_maps = k.row_maps_ref(lay.slot_lens, lay.graph_num_tokens)
    assert torch.equal(lay.row_slot, ref_maps[0]) and torch.equal(lay.row_within, ref_maps[1])
    x = torch.randn(3, 4, 2, device=device)
    packed = lay.pack(x, fill=0.5)
    assert torch.equal(packed, k.pack_ref(x, lay.row_slot, lay.row_within, 7, 0.5))
    assert torch.equal(lay.scatter(packed, fill=-1.0), k.scatter_ref(packed, lay.qo_indptr, 4, 7, -1.0))


@pytest.mark.cpu_only(reason="the dispatch rule for host tensors")
def test_forced_triton_runs_host_tensors_only_under_the_interpreter(triton_backend, monkeypatch):
    """A compiled Triton kernel cannot read host memory: forced `triton` sends CPU tensors to the kernels
    only under TRITON_INTERPRET=1, and a CPU layout still builds beside a GPU (the torch reference)."""
    host = torch.tensor([2, 4, 1], dtype=torch.int32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.use_triton(host)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not dispatch.use_triton(host)
    lay = RaggedVerifyLayout.from_verify_lens(host, tiers=[9], width=4)
    assert torch.equal(lay.row_slot, k.row_maps_ref(lay.slot_lens, lay.graph_num_tokens)[0])
    monkeypatch.setenv(dispatch.BACKEND_ENV, "torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not dispatch.use_triton(host)
