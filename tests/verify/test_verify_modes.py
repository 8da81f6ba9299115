"""The three execution modes: compact -> scatter-back equals static at every real row, and greedy accept
commits the same tokens in every mode when the caps are equal."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark import PagedKV, VerifyExecution, VerifyMode, accept_greedy, build_verify_inputs

MODES = list(VerifyMode)


def _toy_model(vocab: int, seed: int):
    """A per-row 'target': logits depend on (input id, position, KV slot); argmax = next_token(id, pos)."""
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(vocab, vocab, generator=gen)
    mult = int(torch.randint(1, 97, (1,), generator=gen))

    def next_token(ids, pos):
        return (ids * mult + pos * 7 + 3) % vocab

    def forward(ids, pos, kv):
        logits = emb[ids.cpu()].to(ids.device) + torch.sin(pos.float() + 0.1 * kv.float())[:, None]
        peak = torch.nn.functional.one_hot(next_token(ids, pos), vocab).float() * 50
        return logits + peak

    return next_token, forward


def _step(b, gamma, vocab, seed, device, page_size=4):
    """Random verify lens, drafts that follow the toy model's greedy chain up to a random cut, KV pages."""
    gen = torch.Generator().manual_seed(seed)
    w = gamma + 1
    next_token, forward = _toy_model(vocab, seed)
    vl = torch.randint(1, w + 1, (b,), generator=gen, dtype=torch.int32)
    root = torch.randint(0, vocab, (b,), generator=gen)
    prefix = torch.randint(0, 40, (b,), generator=gen)
    cut = torch.randint(0, w, (b,), generator=gen)
    drafts, tok = [], root
    for i in range(gamma):  # over positions, not requests
        nxt = next_token(tok, prefix + i)
        nxt = torch.where(i < cut, nxt, (nxt + 1 + torch.randint(0, vocab - 1, (b,), generator=gen)) % vocab)
        drafts.append(nxt)
        tok = nxt
    draft = torch.stack(drafts, 1)
    pages = (40 + w + page_size - 1) // page_size + 1
    table = torch.randperm(b * pages, generator=gen).view(b, pages)
    put = lambda t: t.to(device)  # noqa: E731
    return dict(verify_lens=put(vl), root_tokens=put(root), draft_tokens=put(draft), prefix_lens=put(prefix),
                kv=PagedKV(put(table), page_size)), forward, cut


@given(b=st.integers(1, 300), gamma=st.integers(1, 16), vocab=st.integers(2, 40), seed=st.integers(0, 10**6),
       extra=st.integers(0, 9))
@settings(max_examples=15)
def test_compact_scatter_back_equals_static(b, gamma, vocab, seed, extra, device):
    args, forward, _ = _step(b, gamma, vocab, seed, device)
    w = gamma + 1
    static = build_verify_inputs(VerifyExecution("static"), **args)
    total = int(args["verify_lens"].sum())
    compact = build_verify_inputs(VerifyExecution("compact", [total + extra], b + 1 + extra), **args)
    lay = compact.layout
    assert lay.graph_num_tokens == total + extra and static.layout.total_rows == b * w
    real = torch.arange(w, device=device)[None, :] < args["verify_lens"][:, None]
    s_logits = forward(static.input_ids, static.positions, static.kv_slots).view(b, w, vocab)
    c_logits = forward(compact.input_ids, compact.positions, compact.kv_slots)
    back = lay.scatter(c_logits, fill=float("nan"))
    assert torch.equal(back[real], s_logits[real])
    assert bool(back[~real].isnan().all())
    for name in ("input_ids", "positions", "kv_slots"):
        s_val = getattr(static, name).view(b, w)
        c_val = lay.scatter(getattr(compact, name), fill=-9)
        assert torch.equal(c_val[real], s_val[real]), name
    # padding rows never write the KV cache; real rows write distinct slots
    assert bool((compact.kv_slots[lay.total_rows:] == -1).all())
    assert compact.kv_slots[: lay.total_rows].unique().numel() == total


@given(b=st.integers(1, 300), gamma=st.integers(1, 16), vocab=st.integers(2, 40), seed=st.integers(0, 10**6))
@settings(max_examples=15)
def test_greedy_identical_in_all_modes(b, gamma, vocab, seed, device):
    args, forward, cut = _step(b, gamma, vocab, seed, device)
    vl = args["verify_lens"]
    results = {}
    for mode in MODES:
        inp = build_verify_inputs(VerifyExecution(mode, [int(vl.sum()) + 3], b + 4), **args)
        logits = forward(inp.input_ids, inp.positions, inp.kv_slots)
        caps = vl if mode is VerifyMode.STATIC else inp.caps  # static run, then capped at accept time
        results[mode] = accept_greedy(args["draft_tokens"], logits, verify_lens=caps, layout=inp.layout)
        if mode is VerifyMode.STATIC:  # the strided view of the same logits gives the same answer
            strided = logits[: b * (gamma + 1)].view(b, gamma + 1, vocab)
            assert_same(results[mode], accept_greedy(args["draft_tokens"], strided, verify_lens=caps))
    assert torch.equal(results[VerifyMode.CAP_ACCEPT].correct_lens.cpu(),
                       torch.minimum(cut, vl.cpu().long() - 1).int())
    for mode in MODES[1:]:
        assert_same(results[MODES[0]], results[mode])


def assert_same(a, b):
    for name in ("correct_lens", "commit_lens", "bonus", "tokens", "proposed", "accepted"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_caps_per_mode(device):
    args, _, _ = _step(5, 3, 11, 1, device)
    caps = {m: build_verify_inputs(VerifyExecution(m), **args).caps for m in MODES}
    assert caps[VerifyMode.STATIC].tolist() == [4] * 5
    assert torch.equal(caps[VerifyMode.CAP_ACCEPT], args["verify_lens"].int())
    assert torch.equal(caps[VerifyMode.COMPACT], args["verify_lens"].int())
    no_kv = build_verify_inputs(VerifyExecution("compact"), **{k: v for k, v in args.items() if k != "kv"})
    assert no_kv.kv_slots is None


def test_worked_example(device):
    """verify_lens [2, 1, 4] (design note): 7 compact rows padded to tier 8, cap-accept keeps 12."""
    args = dict(verify_lens=torch.tensor([2, 1, 4]), root_tokens=torch.tensor([5, 6, 7]),
                draft_tokens=torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33]]),
                prefix_lens=torch.tensor([10, 127, 255]))
    args = {k: v.to(device) for k, v in args.items()}
    table = torch.arange(3 * 80, device=device).view(3, 80)
    inp = build_verify_inputs(VerifyExecution("compact", [4, 8, 16], 8), **args, kv=PagedKV(table, 4))
    assert inp.input_ids.tolist() == [5, 11, 6, 7, 31, 32, 33, 0]
    assert inp.positions.tolist() == [10, 11, 127, 255, 256, 257, 258, 0]
    page = lambda r, pos: int(table[r, pos // 4]) * 4 + pos % 4  # noqa: E731
    assert inp.kv_slots.tolist() == [page(0, 10), page(0, 11), page(1, 127), page(2, 255), page(2, 256),
                                     page(2, 257), page(2, 258), -1]
    cap = build_verify_inputs(VerifyExecution("cap-accept"), **args)
    assert cap.layout.graph_num_tokens == 12 and cap.caps.tolist() == [2, 1, 4]


@pytest.mark.parametrize(
    "change, err, needle",
    [
        (dict(verify_lens=[2, 0, 1]), ValueError, "verify_lens[1] = 0 is outside [1, W=4]"),
        (dict(verify_lens=[2, 5, 1]), ValueError, "verify_lens[1] = 5 is outside [1, W=4]"),
        (dict(verify_lens=[2, 1]), ValueError, "verify_lens must be [B=3]"),
        (dict(prefix_lens=[0, -3, 1]), ValueError, "prefix_lens[1] = -3 is negative"),
        (dict(root_tokens=[1, 2]), ValueError, "root_tokens must be [B=3]"),
        (dict(page_size=None), ValueError, "page_size must be an int >= 1, got None"),
        (dict(page_size=0), ValueError, "page_size must be an int >= 1, got 0"),
        (dict(block_table=torch.zeros(3, 1, dtype=torch.int64)), ValueError, "request 2 writes positions up to 12"),
        (dict(block_table=torch.zeros(2, 4, dtype=torch.int64)), ValueError,
         "block_table must be an integer [B=3, pages]"),
        (dict(block_table=torch.zeros(3, 4)), ValueError,
         "block_table must be an integer [B, pages] tensor, got torch.float32"),
        (dict(mode="ragged"), ValueError, "unknown verify mode 'ragged'"),
    ],
)
def test_bad_inputs(change, err, needle, device):
    args = dict(mode="compact", verify_lens=[2, 1, 4], root_tokens=[5, 6, 7],
                draft_tokens=[[1, 2, 3]] * 3, prefix_lens=[0, 3, 9],
                block_table=torch.arange(12).view(3, 4), page_size=4)
    args.update(change)
    args = {k: torch.tensor(v).to(device) if isinstance(v, list) else v for k, v in args.items()}
    mode, table, page_size = args.pop("mode"), args.pop("block_table"), args.pop("page_size")
    with pytest.raises(err) as info:  # the settings objects check theirs when built, the call the step's tensors
        build_verify_inputs(VerifyExecution(mode), **args, kv=PagedKV(table, page_size))
    assert needle in str(info.value)


def test_settings_are_checked_objects(device):
    args, _, _ = _step(2, 3, 11, 1, device)
    with pytest.raises(TypeError, match="execution must be a VerifyExecution, got str: 'compact'"):
        build_verify_inputs("compact", **args)
    with pytest.raises(TypeError, match="kv must be a PagedKV or None, got tuple"):
        build_verify_inputs(VerifyExecution("compact"), **{**args, "kv": (args["kv"].block_table, 4)})
    with pytest.raises(ValueError, match="graph_slots must be an int >= 1, got 0"):
        VerifyExecution("compact", [8], 0)
    with pytest.raises(ValueError, match=r"tiers must be strictly increasing, got \[8, 4\]"):
        VerifyExecution("compact", [8, 4])
    assert VerifyExecution("cap-accept").mode is VerifyMode.CAP_ACCEPT


def test_reused_planner_layout(device):
    """Compact inputs built on the planner's layout equal those built from scratch; a layout that does not
    belong to these verify_lens / tiers / slots, or any reuse outside compact mode, is refused."""
    from dspark.verify.layout import RaggedVerifyLayout

    args, _, _ = _step(9, 4, 13, 3, device)
    tiers, slots = [8, 16, 32, 48], 9 + 10
    padded = VerifyExecution("compact", tiers, slots)
    fresh = build_verify_inputs(padded, **args)
    layout = RaggedVerifyLayout.from_verify_lens(args["verify_lens"], tiers, slots, width=5)
    reused = build_verify_inputs(padded, **args, layout=layout)
    assert reused.layout is layout
    for name in ("input_ids", "positions", "kv_slots", "caps"):
        assert torch.equal(getattr(reused, name), getattr(fresh, name)), name
    changed = args["verify_lens"].clone()
    changed[0] = 2 if int(changed[0]) == 1 else 1
    other = RaggedVerifyLayout.from_verify_lens(changed, tiers, slots, width=5)
    with pytest.raises(ValueError, match="layout was built for verify_lens"):
        build_verify_inputs(padded, **args, layout=other)
    with pytest.raises(ValueError, match="only used in compact mode"):
        build_verify_inputs(VerifyExecution("cap-accept"), **args, layout=layout)
    with pytest.raises(ValueError, match="was not built with tiers=\\[\\]"):
        build_verify_inputs(VerifyExecution("compact"), **args, layout=layout)
    with pytest.raises(ValueError, match="holds 9 requests, the batch has 8"):
        build_verify_inputs(VerifyExecution("compact"), **{k: v[:8] for k, v in args.items() if k != "kv"},
                            kv=PagedKV(args["kv"].block_table[:8], 4), layout=layout)
