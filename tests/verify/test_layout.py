import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dspark import RaggedVerifyLayout
from dspark.verify.layout import PAD_SLOT


def test_worked_example_padded_to_tier(device):
    vl = torch.tensor([2, 1, 4], dtype=torch.int32, device=device)
    lay = RaggedVerifyLayout.from_verify_lens(vl, tiers=[4, 8, 16], graph_slots=8, width=4)
    assert lay.qo_indptr.device == vl.device and lay.row_slot.device == vl.device
    assert lay.qo_indptr.tolist() == [0, 2, 3, 7]
    assert (lay.total_rows, lay.graph_num_tokens, lay.tier) == (7, 8, 8)
    assert lay.slot_lens.tolist() == [2, 1, 4, 1, 0, 0, 0, 0]
    assert lay.slot_qo_indptr.tolist() == [0, 2, 3, 7, 8, 8, 8, 8, 8]
    assert lay.seqused.tolist() == [2, 1, 4, 0, 0, 0, 0, 0]
    assert lay.row_slot.tolist() == [0, 0, 1, 2, 2, 2, 2, 3]
    assert lay.row_within.tolist() == [0, 1, 0, 0, 1, 2, 3, 0]
    assert lay.positions(torch.tensor([10, 127, 255], device=device)).tolist() == [10, 11, 127, 255, 256, 257, 258, 0]


def test_eager_past_largest_tier_and_error_option(device):
    vl = torch.full((3,), 4, dtype=torch.int32, device=device)
    lay = RaggedVerifyLayout.from_verify_lens(vl, tiers=[4, 8], width=4)
    assert lay.tier is None and lay.graph_num_tokens == 12 and "largest captured tier 8" in lay.eager_reason
    with pytest.raises(ValueError, match="12 verify rows exceed"):
        RaggedVerifyLayout.from_verify_lens(vl, tiers=[4, 8], width=4, on_overflow="error")


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(verify_lens=[2, 0, 1], width=4), "verify_lens[1] = 0"),
        (dict(verify_lens=[2, 5], width=4), "verify_lens[1] = 5"),
        (dict(verify_lens=[2, 2], tiers=[8, 4]), "strictly increasing"),
        (dict(verify_lens=[2, 2], tiers=[8], graph_slots=2), "ghost slot"),
        (dict(verify_lens=[2, 2], tiers=[64], graph_slots=3, width=4), "do not fit"),
        (dict(verify_lens=[2, 2], graph_slots=1), "graph_slots must be"),
    ],
)
def test_bad_layouts(kwargs, needle, device):
    kwargs = dict(kwargs, verify_lens=torch.tensor(kwargs["verify_lens"], dtype=torch.int32, device=device))
    with pytest.raises(ValueError) as info:
        RaggedVerifyLayout.from_verify_lens(**kwargs)
    assert needle in str(info.value)


@given(b=st.integers(0, 40), w=st.integers(1, 9), extra=st.integers(0, 20), seed=st.integers(0, 1000))
def test_pack_scatter_roundtrip(b, w, extra, seed, device):
    gen = torch.Generator().manual_seed(seed)
    vl = torch.randint(1, w + 1, (b,), generator=gen, dtype=torch.int32)
    total = int(vl.sum())
    tier = total + extra
    lay = RaggedVerifyLayout.from_verify_lens(vl.to(device), tiers=[max(tier, 1)], graph_slots=b + 1 + extra, width=w)
    strided = torch.randn(b, w, 3, generator=gen).to(device)
    packed = lay.pack(strided, fill=float("nan"))
    assert packed.shape == (lay.graph_num_tokens, 3)
    assert bool(packed[lay.total_rows:].isnan().all())
    back = lay.scatter(packed, fill=-7.0)
    mask = torch.arange(w, device=device)[None, :] < vl.to(device)[:, None]
    assert torch.equal(back[mask], strided[mask])
    assert bool((back[~mask] == -7.0).all())


@given(b=st.integers(0, 9), w=st.integers(1, 6), extra=st.integers(0, 7), page_size=st.integers(1, 5),
       seed=st.integers(0, 1000))
def test_kv_slots_match_the_block_table_formula(b, w, extra, page_size, seed, device):
    """Real row i of request r writes block_table[r, pos // page_size] * page_size + pos % page_size at
    pos = prefix_lens[r] + i; padding rows write PAD_SLOT; an empty block table works when B = 0."""
    gen = torch.Generator().manual_seed(seed)
    vl = torch.randint(1, w + 1, (b,), generator=gen, dtype=torch.int32)
    total = int(vl.sum())
    lay = RaggedVerifyLayout.from_verify_lens(vl.to(device), tiers=[total + extra + 1], width=w)
    prefix = torch.randint(0, 12, (b,), generator=gen)
    pages = -(-(12 + w) // page_size) if b else 0
    table = torch.randperm(max(b * pages, 1), generator=gen)[: b * pages].view(b, pages)
    got = lay.kv_slots(lay.positions(prefix.to(device)), table.to(device), page_size).cpu()
    want = [table[r, (prefix[r] + i) // page_size] * page_size + (prefix[r] + i) % page_size
            for r in range(b) for i in range(int(vl[r]))]
    assert got.dtype == torch.int64 and got.shape == (lay.graph_num_tokens,)
    assert got[:total].tolist() == [int(x) for x in want]
    assert bool((got[total:] == PAD_SLOT).all()) and lay.num_padding_rows == extra + 1


def test_to_moves_every_tensor_and_keeps_the_geometry(device):
    """A host-built layout handed to the device under test (the planner's accelerator path): every tensor
    moves with its values, the ints and the tier stay."""
    lay = RaggedVerifyLayout.from_verify_lens(torch.tensor([3, 1, 4], dtype=torch.int32), tiers=[10], graph_slots=5,
                                              width=4)
    tensors = ("verify_lens", "qo_indptr", "slot_lens", "slot_qo_indptr", "seqused", "row_slot", "row_within")
    for target in ("meta", device):
        moved = lay.to(target)
        assert all(getattr(moved, f).device.type == torch.device(target).type
                   and getattr(moved, f).shape == getattr(lay, f).shape
                   and getattr(moved, f).dtype == getattr(lay, f).dtype for f in tensors)
        assert (moved.total_rows, moved.graph_num_tokens, moved.tier, moved.width) == (8, 10, 10, 4)
    on_device = lay.to(device)
    assert all(torch.equal(getattr(on_device, f).cpu(), getattr(lay, f)) for f in tensors)
    assert lay.to("cpu").row_slot.data_ptr() == lay.row_slot.data_ptr()  # same device: no copy


@given(b=st.integers(1, 9), gamma=st.integers(1, 6), seed=st.integers(0, 2**31 - 1), pad=st.integers(0, 7),
       mode=st.sampled_from(["static", "cap-accept", "compact"]))
def test_private_verify_inputs_equal_the_checked_build(b, gamma, seed, pad, mode, device):
    """The engine's unchecked entry (`_verify_inputs`, over a layout built once) builds what the public,
    checked `build_verify_inputs` builds."""
    from dspark import PagedKV, VerifyExecution, VerifyMode, build_verify_inputs
    from dspark.verify.inputs import _verify_inputs

    g, w = torch.Generator().manual_seed(seed), gamma + 1
    vl = torch.randint(1, w + 1, (b,), generator=g, dtype=torch.int32).to(device)
    root = torch.randint(0, 50, (b,), generator=g).to(device)
    drafts = torch.randint(0, 50, (b, gamma), generator=g).to(device)
    prefix = torch.randint(0, 9, (b,), generator=g).to(device)
    table = torch.randperm(b * 4, generator=g).view(b, 4).to(device)
    rows = int(vl.sum()) if mode == "compact" else b * w
    tiers, slots = [rows + pad], b + 1 + pad
    want = build_verify_inputs(VerifyExecution(mode, tiers, slots), vl, root, drafts, prefix, kv=PagedKV(table, 4))
    lens = vl if mode == "compact" else torch.full_like(vl, w)
    layout = RaggedVerifyLayout._from_lens(lens, tuple(tiers), slots, w, total_rows=rows)
    got = _verify_inputs(VerifyMode(mode), vl, root, drafts, prefix.to(torch.int64), layout, table, 4)
    for name in ("input_ids", "positions", "kv_slots", "caps"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.layout.graph_num_tokens == want.layout.graph_num_tokens == rows + pad
    assert bool((got.kv_slots[: rows] >= 0).all()) and bool((got.kv_slots[rows:] == -1).all())
