"""ConfidenceHead indexing (no dependence on a draft's own token), soft target 1 - TV, and the loss."""
import math

import pytest
import torch

from dspark.calibration.confidence import (
    ConfidenceHead,
    check_prefix_mask,
    confidence_loss,
    previous_tokens,
    soft_accept_target,
)


@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_confidence_of_draft_k_ignores_draft_k_token(device, k):
    torch.manual_seed(0)
    b, g, h, v = 3, 5, 8, 11
    head = ConfidenceHead(h, markov_rank=4, vocab_size=v).to(device)
    hidden = torch.randn(b, g, h, device=device)
    anchor = torch.randint(0, v, (b,), device=device)
    drafts = torch.randint(0, v, (b, g), device=device)
    base = head(hidden, previous_tokens(anchor, drafts))
    changed = drafts.clone()
    changed[:, k] = (changed[:, k] + 1) % v
    out = head(hidden, previous_tokens(anchor, changed))
    assert torch.equal(out[:, : k + 1], base[:, : k + 1])  # drafts 0..k never see draft k's token
    if k + 1 < g:
        assert not torch.equal(out[:, k + 1], base[:, k + 1])  # draft k+1 does (the test can fail)
    assert torch.equal(out[:, k + 2:], base[:, k + 2:])  # first-order Markov: only the next position


def test_previous_tokens_indexing(device):
    anchor = torch.tensor([7, 8], device=device)
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6]], device=device)
    assert previous_tokens(anchor, drafts).tolist() == [[7, 1, 2], [8, 4, 5]]


def test_head_without_markov_and_bad_args(device):
    head = ConfidenceHead(6).to(device)
    hidden = torch.randn(2, 3, 6, device=device)
    assert head(hidden).shape == (2, 3)
    with pytest.raises(ValueError, match="markov_rank=0"):
        head(hidden, torch.zeros(2, 3, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match=r"\[B, gamma, 6\].*\(2, 3, 5\)"):
        head(torch.randn(2, 3, 5, device=device))
    with pytest.raises(ValueError, match="vocab_size.*None"):
        ConfidenceHead(6, markov_rank=2)
    with pytest.raises(ValueError, match="hidden_size.*0"):
        ConfidenceHead(0)
    markov = ConfidenceHead(6, markov_rank=2, vocab_size=9).to(device)
    with pytest.raises(ValueError, match="prev_tokens"):
        markov(hidden)


def test_soft_accept_target_hand_case(device):
    q = torch.zeros(1, 2, device=device, dtype=torch.bfloat16)  # uniform (0.5, 0.5)
    p = torch.tensor([[math.log(0.7), math.log(0.3)]], device=device)
    a = soft_accept_target(q, p)
    assert a.dtype == torch.float32 and a.shape == (1,)
    assert a.item() == pytest.approx(0.8, abs=1e-6)  # 1 - 0.5 * (0.2 + 0.2)
    x = torch.randn(4, 3, 9, device=device)
    assert torch.allclose(soft_accept_target(x, x), torch.ones(4, 3, device=device))
    far = torch.tensor([[30.0, -30.0]], device=device)
    assert soft_accept_target(far, -far).item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="equal shape"):
        soft_accept_target(x, x[..., :5])


def test_confidence_loss_hand_case(device):
    logits = torch.tensor([[0.0, 2.0, -1.0]], device=device, requires_grad=True)
    target = torch.tensor([[1.0, 0.0, float("nan")]], device=device)  # censored position holds NaN
    mask = torch.tensor([[1, 1, 0]], device=device)
    loss = confidence_loss(logits, target, mask, decay=1.0)
    w1 = math.exp(-1.0)
    want = (math.log(2.0) + w1 * math.log1p(math.exp(2.0))) / (1.0 + w1)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 2].item() == 0.0
    flat = confidence_loss(logits.detach(), torch.nan_to_num(target), mask, decay=math.inf)
    assert flat.item() == pytest.approx((math.log(2.0) + math.log1p(math.exp(2.0))) / 2, rel=1e-6)


def test_confidence_loss_rejects_bad_mask_and_decay(device):
    z = torch.zeros(2, 3, device=device)
    with pytest.raises(ValueError, match=r"row 1 is \[1, 0, 1\]"):
        confidence_loss(z, z, torch.tensor([[1, 1, 0], [1, 0, 1]], device=device), decay=2.0)
    with pytest.raises(ValueError, match=r"0/1.*= 2"):
        check_prefix_mask(torch.tensor([[1, 2]], device=device))
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="decay"):
            confidence_loss(z, z, torch.ones(2, 3, device=device), decay=bad)


def test_per_position_terms_and_their_bad_args(device):
    head = ConfidenceHead(6, num_features=2, positions=3).to(device)
    hidden = torch.randn(2, 3, 6, device=device)
    with torch.no_grad():
        head.position_weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]]))
        head.position_bias.copy_(torch.tensor([0.5, -0.5, 0.0]))
    z = head(hidden)
    base = head.proj(hidden).squeeze(-1)
    want = base + torch.stack([0.5 + hidden[:, 0, 4], -0.5 + 2 * hidden[:, 1, 5], base.new_zeros(2)], 1)
    torch.testing.assert_close(z, want)
    assert ConfidenceHead(6, num_features=2).num_features == 0  # no positions: no per-position terms
    with pytest.raises(ValueError, match="num_features=7 exceeds hidden_size=6"):
        ConfidenceHead(6, num_features=7, positions=2)
    with pytest.raises(ValueError, match="positions must be an int >= 0, got -1"):
        ConfidenceHead(6, num_features=2, positions=-1)
