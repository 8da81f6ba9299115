"""Accept Triton kernels == their torch references (interpreter on the CPU), strided and packed rows."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark import RaggedVerifyLayout
from dspark.kernels import accept as k
from dspark.kernels import dispatch

POLICIES = [("work", None), ("cores", 3)]
POISON = -12345


def _case(b, gamma, vocab, seed, packed, device, extra_rows=3):
    """Drafts, verify lens and (packed or strided) row geometry; half the drafts copy the target argmax."""
    gen = torch.Generator().manual_seed(seed)
    w = gamma + 1
    vl = torch.randint(1, w + 1, (b,), generator=gen, dtype=torch.int32)
    draft = torch.randint(0, vocab, (b, gamma), generator=gen)
    layout = None
    if packed:
        total = int(vl.sum())
        layout = RaggedVerifyLayout.from_verify_lens(vl, tiers=[total + extra_rows], graph_slots=b + extra_rows, width=w)
    return gen, draft.to(device), vl.to(device), layout


def _outs(b, device):
    return (torch.full((b,), POISON, dtype=torch.int32, device=device),
            torch.full((b,), POISON, dtype=torch.int64, device=device))


def _rows(layout, b, w, gen, make, device):
    """Target rows: strided [B, W, V] or packed [tier, V] (padding rows poisoned with NaN)."""
    if layout is None:
        return make((b, w)).to(device), None
    rows = make((layout.graph_num_tokens,))
    rows[layout.total_rows:] = float("nan")
    return rows.to(device), layout.qo_indptr[:-1].to(device)


@pytest.mark.parametrize("policy", POLICIES)
@given(b=st.integers(0, 9), gamma=st.integers(1, 6), vocab=st.sampled_from([1, 2, 5, 37, 1100]),
       seed=st.integers(0, 10**6), packed=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
@settings(max_examples=8)
def test_greedy_kernel_matches_reference(policy, b, gamma, vocab, seed, packed, dtype, device):
    gen, draft, vl, layout = _case(b, gamma, vocab, seed, packed, device)
    # small integer logits: many ties (first maximum wins), some NaN and -inf rows
    make = lambda shape: torch.randint(-2, 3, (*shape, vocab), generator=gen).to(dtype)  # noqa: E731
    logits, row_start = _rows(layout, b, gamma + 1, gen, make, device)
    if logits.numel():
        flat = logits.view(-1, vocab)
        at_row = torch.randint(0, flat.shape[0], (2,), generator=gen)
        flat[at_row, torch.randint(0, vocab, (2,), generator=gen)] = float("nan")
        flat[0] = float("-inf")
    with dispatch.launch_policy(*policy):
        got = k.greedy_triton(draft, logits, vl, row_start, *_outs(b, device))
    ref = k.greedy_ref(draft, logits, vl, row_start)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("policy", POLICIES)
@given(b=st.integers(1, 7), gamma=st.integers(1, 5), vocab=st.sampled_from([3, 37, 1100]),
       seed=st.integers(0, 10**6), packed=st.booleans())
@settings(max_examples=6)
def test_greedy_kernel_long_matches(policy, b, gamma, vocab, seed, packed, device):
    """Drafts equal to the target argmax at random prefixes: correct_lens spans 0..verify_len-1."""
    gen, _, vl, layout = _case(b, gamma, vocab, seed, packed, device)
    w = gamma + 1
    strided = torch.randn(b, w, vocab, generator=gen)
    argmax = strided.argmax(-1)
    cut = torch.randint(0, w, (b, 1), generator=gen)
    draft = torch.where(torch.arange(gamma)[None, :] < cut, argmax[:, :gamma], (argmax[:, :gamma] + 1) % vocab)
    logits = strided if layout is None else layout.pack(strided, fill=float("nan"))
    row_start = None if layout is None else layout.qo_indptr[:-1].to(device)
    logits, draft = logits.to(device), draft.to(device)
    with dispatch.launch_policy(*policy):
        got = k.greedy_triton(draft, logits, vl, row_start, *_outs(b, device))
    ref = k.greedy_ref(draft, logits, vl, row_start)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert torch.equal(ref[0].cpu(), torch.minimum(cut[:, 0], vl.cpu().long() - 1).int())


def _probs(shape, vocab, gen, sparsity):
    """Random distributions with some exact zeros (tokens that cannot be drawn)."""
    x = torch.rand(*shape, vocab, generator=gen) ** 3
    x = x * (torch.rand(*shape, vocab, generator=gen) >= sparsity)
    x[..., 0] += 1e-3
    return x / x.sum(-1, keepdim=True)


@pytest.mark.parametrize("policy", POLICIES)
@given(b=st.integers(0, 9), gamma=st.integers(1, 6), vocab=st.sampled_from([1, 2, 5, 37, 1100]),
       seed=st.integers(0, 10**6), packed=st.booleans(), sparsity=st.sampled_from([0.0, 0.5]),
       same=st.booleans())
@settings(max_examples=10)
def test_sampling_kernel_matches_reference(policy, b, gamma, vocab, seed, packed, sparsity, same, device):
    gen, _, vl, layout = _case(b, gamma, vocab, seed, packed, device)
    q = _probs((b, gamma), vocab, gen, sparsity)
    draft = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(b, gamma) if b else torch.zeros(0, gamma).long()
    strided = _probs((b, gamma + 1), vocab, gen, sparsity)
    if same:  # p == q at drafted rows: every residual (p - q)+ is empty, the draw falls back to p
        strided[:, :gamma] = q
    p = strided if layout is None else layout.pack(strided, fill=float("nan"))
    row_start = None if layout is None else layout.qo_indptr[:-1].to(device)
    u = torch.rand(b, gamma + 1, generator=gen)
    args = (draft.to(device), q.to(device), p.to(device), vl, row_start, u.to(device))
    with dispatch.launch_policy(*policy):
        got = k.sampling_triton(*args, *_outs(b, device))
    ref = k.sampling_ref(*args)
    small_chunks = k.sampling_ref(*args, chunk=7)  # the reference's chunked CDF walk
    for other in (got, small_chunks):
        assert torch.equal(other[0], ref[0])  # the accept tests are the same fp32 products on every path
        # a device sums the CDF in another order: only a draw within rounding of a CDF step may differ
        _assert_same_draw_up_to_rounding(other[1], ref, args)
        if device.type == "cpu":  # sequential sums on the CPU and in the interpreter: bit-identical draws
            assert torch.equal(other[1], ref[1])
    if b:  # the drawn token has positive probability under the distribution it came from
        assert bool((ref[1] >= 0).all() and (ref[1] < vocab).all())


def _draw_candidates(draft, q, p, vl, row_start, u, correct):
    """Per request, the tokens any fp32 summation order may draw: those whose CDF interval (cumulative
    sums of the reference's draw weights, in float64) lies within `eps` of the draw target `u * total`.

    Any order of summing n non-negative fp32 terms is within gamma_n = n * 2^-24 / (1 - n * 2^-24) of the
    exact sum relative to the total, so two implementations (CDF steps, total and the target's product)
    differ by less than eps = 4 * gamma_n * total with n = the positive weights + 1; a target farther than
    eps from every step has exactly one candidate. (Worst case in n: at V = 37 about 0.05% of draws have a
    second candidate, at V = 1100 about 20-30%, each still limited to the few tokens around the target.)
    """
    b, gamma = draft.shape
    rows = correct.long() if row_start is None else row_start.long() + correct.long()
    p_row = p[torch.arange(b), rows] if row_start is None else p[rows]
    q_row = q[torch.arange(b), correct.long().clamp(max=gamma - 1)]
    rejected = (correct < vl - 1)[:, None]
    res = torch.where(rejected, (p_row.float() - q_row.float()).clamp_min(0), p_row.float())
    wts = torch.where((res.sum(-1) <= 0)[:, None], p_row.float(), res).double().cpu()
    cdf = wts.cumsum(-1)
    total = cdf[:, -1:]
    target = u[:, gamma:].double().cpu() * total
    n = (wts > 0).sum(-1, keepdim=True).double() + 1  # zero weights add exactly
    eps = 4 * (n * 2.0**-24 / (1 - n * 2.0**-24)) * total
    lower = torch.cat([torch.zeros(b, 1, dtype=cdf.dtype), cdf[:, :-1]], 1)
    near = (lower - eps <= target) & (target < cdf + eps) & (wts > 0)
    last = (wts > 0).double().cumsum(-1).argmax(-1)  # the last drawable token (the clamp of a draw past the end)
    near[torch.arange(b), last] |= (target >= total - eps)[:, 0]
    return near


def _assert_same_draw_up_to_rounding(draw, ref, args):
    """Draws equal the reference's, except where the target sits within rounding of a CDF step: then
    both must be among that step's candidates (never a token far from the target)."""
    near = _draw_candidates(*args, ref[0])
    draw, want = draw.cpu(), ref[1].cpu()
    differ = draw != want
    ambiguous = near.sum(-1) > 1
    assert not bool((differ & ~ambiguous).any()), (draw[differ], want[differ])
    r = torch.arange(draw.shape[0])
    assert bool(near[r, draw].all() and near[r, want].all())


def test_draw_candidates_are_one_token_unless_the_target_sits_on_a_cdf_step(device):
    """The tolerance used on devices: a single candidate (the reference's draw) away from CDF steps, the
    two neighbours of a step when `u * total` hits it, the last drawable token when the target hits the end."""
    gamma = 1
    p = torch.tensor([[[0.25, 0.0, 0.25, 0.5], [0.25, 0.0, 0.25, 0.5]]] * 3, device=device)
    q = p[:, :1].clone()
    draft = torch.zeros(3, gamma, dtype=torch.int64, device=device)
    vl = torch.full((3,), 2, dtype=torch.int32, device=device)
    u = torch.tensor([[0.0, 0.6], [0.0, 0.5], [0.0, 1.0]], device=device)  # targets 0.6, 0.5 (a step), 1.0 (the end)
    correct, draw = k.sampling_ref(draft, q, p, vl, None, u)
    assert correct.tolist() == [1, 1, 1] and draw.tolist() == [3, 3, 3]
    near = _draw_candidates(draft, q, p, vl, None, u, correct)
    assert near.tolist() == [[False, False, False, True], [False, False, True, True],
                             [False, False, False, True]]
    _assert_same_draw_up_to_rounding(torch.tensor([3, 2, 3], device=device), (correct, draw), (draft, q, p, vl, None, u))
    with pytest.raises(AssertionError):  # 0.6 is no step: token 2 is wrong, not rounding
        _assert_same_draw_up_to_rounding(torch.tensor([2, 3, 3], device=device), (correct, draw), (draft, q, p, vl, None, u))


def test_sampling_kernel_reads_nothing_past_verify_len(device):
    """Poisoned (NaN) rows past each request's verify length leave the kernel result unchanged."""
    gen = torch.Generator().manual_seed(5)
    b, gamma, vocab = 6, 4, 9
    vl = torch.tensor([1, 2, 5, 3, 1, 4], dtype=torch.int32)
    q = _probs((b, gamma), vocab, gen, 0.0)
    p = _probs((b, gamma + 1), vocab, gen, 0.0)
    draft = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(b, gamma)
    u = torch.rand(b, gamma + 1, generator=gen)
    past = torch.arange(gamma + 1)[None, :] >= vl[:, None]
    p_bad, q_bad = p.clone(), q.clone()
    p_bad[past] = float("nan")
    q_bad[past[:, 1:]] = float("nan")
    draft_bad = torch.where(past[:, 1:], torch.full_like(draft, 10**9), draft)
    def ins(d, qq, pp):
        return d.to(device), qq.to(device), pp.to(device), vl.to(device), None, u.to(device)

    clean = k.sampling_triton(*ins(draft, q, p), *_outs(b, device))
    poisoned = k.sampling_triton(*ins(draft_bad, q_bad, p_bad), *_outs(b, device))
    assert torch.equal(clean[0], poisoned[0]) and torch.equal(clean[1], poisoned[1])
