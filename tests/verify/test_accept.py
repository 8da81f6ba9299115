"""accept_greedy / accept_sampling: result fields, caps, rows never read, determinism, bad input."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark import RaggedVerifyLayout, accept_greedy, accept_sampling

BACKENDS = ["torch_backend", "triton_backend"]


def _probs(shape, vocab, gen):
    x = torch.rand(*shape, vocab, generator=gen) ** 2 + 1e-3
    return x / x.sum(-1, keepdim=True)


def _sampling_case(b, gamma, vocab, seed, device):
    gen = torch.Generator().manual_seed(seed)
    q = _probs((b, gamma), vocab, gen)
    p = _probs((b, gamma + 1), vocab, gen)
    draft = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(b, gamma)
    vl = torch.randint(1, gamma + 2, (b,), generator=gen, dtype=torch.int32)
    return draft.to(device), q.to(device), p.to(device), vl.to(device)


def _poison_past(x, vl, start, value):
    """Copy of strided x [B, W', ...] with positions >= vl - start set to value."""
    out = x.clone()
    past = torch.arange(x.shape[1], device=x.device)[None, :] >= (vl[:, None] - start)
    out[past] = value
    return out


def _fields(res):
    return [getattr(res, n) for n in ("correct_lens", "commit_lens", "bonus", "tokens", "proposed", "accepted")]


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(_fields(a), _fields(b)))


@pytest.mark.parametrize("backend", BACKENDS)
@given(b=st.integers(1, 6), gamma=st.integers(1, 5), vocab=st.integers(2, 30), seed=st.integers(0, 10**6))
@settings(max_examples=6)
def test_rows_past_verify_len_never_read(backend, b, gamma, vocab, seed, device, request):
    """NaN in every row past a request's verify length (strided, and packed in a W-row cap-accept layout)
    and out-of-vocabulary ids in unverified drafts leave greedy and sampling results unchanged."""
    request.getfixturevalue(backend)
    draft, q, p, vl = _sampling_case(b, gamma, vocab, seed, device)
    logits = torch.log(p)
    bad_draft = torch.where(_poison_past(torch.zeros_like(draft), vl, 1, 1) == 1, 10**6, draft)
    full = RaggedVerifyLayout.from_verify_lens(torch.full_like(vl, gamma + 1), width=gamma + 1)
    for packed in (False, True):
        lay = full if packed else None
        shape = lambda x: x.reshape(-1, vocab) if packed else x  # noqa: E731
        clean_g = accept_greedy(draft, shape(logits), vl, layout=lay)
        dirty_g = accept_greedy(bad_draft, shape(_poison_past(logits, vl, 0, float("nan"))), vl, layout=lay)
        assert _equal(clean_g, dirty_g)
        g1, g2 = (torch.Generator(device=device).manual_seed(seed) for _ in range(2))
        clean_s = accept_sampling(draft, q, shape(p), vl, generator=g1, layout=lay)
        dirty_s = accept_sampling(bad_draft, _poison_past(q, vl, 1, float("nan")),
                                  shape(_poison_past(p, vl, 0, float("nan"))), vl, generator=g2, layout=lay)
        assert _equal(clean_s, dirty_s)


@given(b=st.integers(0, 8), gamma=st.integers(1, 6), vocab=st.integers(2, 20), seed=st.integers(0, 10**6))
@settings(max_examples=10)
def test_result_fields(b, gamma, vocab, seed, device):
    draft, q, p, vl = _sampling_case(b, gamma, vocab, seed, device)
    res = accept_sampling(draft, q, p, vl, generator=torch.Generator(device=device).manual_seed(seed))
    w = gamma + 1
    assert res.commit_lens.dtype == torch.int32 and res.correct_lens.dtype == torch.int32
    assert torch.equal(res.commit_lens, torch.minimum(res.correct_lens, vl - 1) + 1)
    assert bool((res.correct_lens <= vl - 1).all())
    pos = torch.arange(w, device=device)[None, :]
    c = res.correct_lens[:, None].long()
    assert torch.equal(res.tokens[:, :gamma][pos[:, :gamma] < c], draft[pos[:, :gamma] < c].long())
    assert torch.equal(res.tokens.gather(1, c)[:, 0], res.bonus)
    assert bool((res.tokens[pos > c] == -1).all())
    assert torch.equal(res.proposed.sum(1), (vl - 1).long())
    assert torch.equal(res.accepted.sum(1), res.correct_lens.long())
    assert bool((res.accepted <= res.proposed).all())
    # the bonus has positive target probability at its row
    rows = p[torch.arange(b, device=device), res.correct_lens.long()]
    assert bool((rows.gather(1, res.bonus[:, None]) > 0).all())


@pytest.mark.parametrize("packed", [False, True])
def test_sampling_deterministic_and_backend_independent(packed, device, monkeypatch):
    """Equal generators give equal results; the Triton kernel and the torch path agree exactly."""
    draft, q, p, vl = _sampling_case(7, 4, 13, 3, device)
    lay = None
    if packed:
        lay = RaggedVerifyLayout.from_verify_lens(vl, tiers=[int(vl.sum()) + 2], width=5)
        p = lay.pack(p, fill=float("nan"))
    runs = []
    for backend in ("torch", "triton", "triton"):
        monkeypatch.setenv("DSPARK_KERNEL_BACKEND", backend)
        gen = torch.Generator(device=device).manual_seed(11)
        runs.append(accept_sampling(draft, q, p, vl, generator=gen, layout=lay))
    assert _equal(runs[0], runs[1]) and _equal(runs[1], runs[2])


def test_greedy_worked_example(device):
    """Drafts [7, 8, 9]; target argmax rows [7, 8, 5, 2]: two drafts match, bonus 5; capped by verify_len."""
    logits = torch.full((2, 4, 10), -1.0, device=device)
    for i, t in enumerate([7, 8, 5, 2]):
        logits[:, i, t] = 1.0
    draft = torch.tensor([[7, 8, 9], [7, 8, 9]], device=device)
    res = accept_greedy(draft, logits, torch.tensor([4, 2], device=device))
    assert res.correct_lens.tolist() == [2, 1] and res.commit_lens.tolist() == [3, 2]
    assert res.bonus.tolist() == [5, 8]
    assert res.tokens.tolist() == [[7, 8, 5, -1], [7, 8, -1, -1]]
    assert res.proposed.tolist() == [[True, True, True], [True, False, False]]
    assert res.accepted.tolist() == [[True, True, False], [True, False, False]]


def _bad(**change):
    gen = torch.Generator().manual_seed(0)
    args = dict(draft_tokens=torch.tensor([[1, 2], [3, 0]]), draft_probs=_probs((2, 2), 5, gen),
                target_probs=_probs((2, 3), 5, gen), verify_lens=torch.tensor([3, 2]))
    args.update(change)
    return args


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(verify_lens=torch.tensor([3, 0])), "verify_lens[1] = 0 is outside [1, W=3]"),
        (dict(verify_lens=torch.tensor([4, 2])), "verify_lens[0] = 4 is outside [1, W=3]"),
        (dict(verify_lens=torch.tensor([3])), "verify_lens must be an integer [B=2]"),
        (dict(draft_tokens=torch.tensor([[1, 7], [3, 0]])), "draft_tokens[0, 1] = 7 is outside the vocabulary [0, 5)"),
        (dict(draft_tokens=torch.tensor([[1, 2], [-1, 0]])), "draft_tokens[1, 0] = -1 is outside"),
        (dict(target_probs=torch.rand(2, 4, 5)), "strided target_probs must be [B=2, W=3, V]"),
        (dict(draft_probs=torch.rand(2, 2, 6)), "draft_probs must be [B=2, gamma=2, V=5]"),
        (dict(target_probs=_bad()["target_probs"].index_put((torch.tensor(1), torch.tensor(1), torch.tensor(2)),
                                                             torch.tensor(-0.25))),
         "target_probs row (request 1, position 1) has a negative entry -0.25"),
        (dict(target_probs=_bad()["target_probs"] * 1.5), "target_probs row (request 0, position 0) sums to 1.5"),
        (dict(draft_probs=_bad()["draft_probs"].index_put((torch.tensor(0), torch.tensor(1)),
                                                           torch.tensor(float("nan")))),
         "draft_probs row (request 0, position 1) holds NaN"),
    ],
)
def test_bad_sampling_inputs(change, needle, device):
    args = {k: v.to(device) for k, v in _bad(**change).items()}
    with pytest.raises(ValueError) as info:
        accept_sampling(**args)
    assert needle in str(info.value)


def test_bad_greedy_inputs(device):
    logits = torch.randn(2, 3, 5, device=device)
    draft = torch.tensor([[1, 2], [3, 4]], device=device)
    with pytest.raises(TypeError, match="draft_tokens must be an integer"):
        accept_greedy(draft.float(), logits, torch.tensor([1, 2], device=device))
    lay = RaggedVerifyLayout.from_verify_lens(torch.tensor([1, 2], device=device), width=3)
    with pytest.raises(ValueError, match=r"verify_lens\[1\] = 3 exceeds the rows the layout gave request 1: 2"):
        accept_greedy(draft, logits.view(6, 5), torch.tensor([1, 3], device=device), layout=lay)
    with pytest.raises(ValueError, match=r"packed target_logits must be \[rows >= 3, V\]"):
        accept_greedy(draft, logits.view(6, 5)[:2], torch.tensor([1, 2], device=device), layout=lay)
    with pytest.raises(ValueError, match=r"layout has 2 requests, draft_tokens has 1"):
        accept_greedy(draft[:1], logits.view(6, 5), torch.tensor([1], device=device), layout=lay)
