"""Reference engine: losslessness, sampling distribution, bad input (tiny untrained models, short runs)."""
from __future__ import annotations

import pytest
import torch

from dspark.config import VerifyMode
from dspark.engine.decode import SpecDecoder, check_device
from dspark.engine.model import DraftLM, ModelConfig, TinyLM
from dspark.engine.policies import FixedK, Oracle

MODES = [m.value for m in VerifyMode]


pytestmark = pytest.mark.usefixtures("one_thread")


def _models(vocab: int = 256, noise: float = 0.3, seed: int = 0, embed_std: float = 1.0,
            gamma: int = 4) -> tuple[TinyLM, DraftLM]:
    """A tiny target and a draft = perturbed copy of it with near-identity heads (partial, varied acceptance)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=64, vocab_size=vocab)
    target = TinyLM(cfg)
    with torch.no_grad():
        target.embed.weight.normal_(0, embed_std)  # std 1: peaked, greedy agreement is meaningful
    draft = DraftLM(cfg, gamma, markov_rank=4)  # the previous-token head input: the decode loop passes anchors
    draft.load_state_dict(target.state_dict(), strict=False)
    with torch.no_grad():
        for p in draft.blocks.parameters():
            p.add_(noise * torch.randn_like(p) * p.std().clamp_min(1e-3))
        for p in draft.heads.parameters():
            p.mul_(0.1)
    return target, draft


@pytest.fixture(scope="module")
def decoder(device) -> SpecDecoder:
    target, draft = _models()
    return SpecDecoder(target, draft, cache_tokens=4096, page_size=8, device=device)


def _prompts(b: int, p: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (b, p), generator=torch.Generator().manual_seed(seed))


def _policies(gamma: int) -> list:
    return [FixedK(k) for k in range(gamma + 1)] + [Oracle(gamma)]


def test_greedy_lossless_every_mode_and_policy(decoder: SpecDecoder) -> None:
    prompts = _prompts(5, 6)
    ref = decoder.generate(prompts, 16, FixedK(0), mode="static")
    assert len(ref.steps) == 16  # target-only: one token per step
    accepted_any = False
    for mode in MODES:
        for policy in _policies(3):
            out = decoder.generate(prompts, 16, policy, mode=mode)
            assert torch.equal(out.tokens, ref.tokens), (mode, policy.name)
            commits = torch.cat([s.commit_lens for s in out.steps])
            accepted_any |= bool((commits > 1).any())
            assert int(commits.max()) <= policy.num_drafts + 1
    assert accepted_any, "the perturbed draft never got a token accepted: the test would not exercise accept"


def test_oracle_verifies_only_accepted_rows(decoder: SpecDecoder) -> None:
    out = decoder.generate(_prompts(4, 5), 12, Oracle(3), mode="compact")
    for s in out.steps:
        assert torch.equal(s.plan.verify_lens.long(), s.commit_lens.long())
        assert s.layout.total_rows == int(s.commit_lens.sum())


def _exact_two_token_dist(target: TinyLM, prompt: torch.Tensor, temperature: float) -> torch.Tensor:
    """p(t1, t2 | prompt) by enumeration with the dense forward: [V, V]."""
    v = target.cfg.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(target.logits(target.forward_dense(prompt[None]))[0, -1] / temperature, -1)
        ctx = torch.cat([prompt[None].expand(v, -1), torch.arange(v)[:, None]], 1)
        p2 = torch.softmax(target.logits(target.forward_dense(ctx))[:, -1] / temperature, -1)
    return p1[:, None] * p2


@pytest.mark.parametrize("mode", MODES)
def test_sampling_matches_target_distribution(mode: str) -> None:
    """Chi-square of the emitted (t1, t2) pairs against the exact target distribution, on a small vocab."""
    vocab, n, temp = 6, 3000, 4.0
    target, _ = _models(vocab=vocab, seed=3, embed_std=0.3)
    torch.manual_seed(4)
    draft = DraftLM(target.cfg, 3)  # independent weights: both accepts and rejects happen
    dec = SpecDecoder(target, draft, cache_tokens=n * 16, page_size=8)
    prompt = torch.tensor([1, 4, 2, 5, 0])
    exact = _exact_two_token_dist(target, prompt, temp).flatten().double()
    out = dec.generate(prompt[None].expand(n, -1).contiguous(), 2, FixedK(3), mode=mode, sampling=True,
                       temperature=temp, seed=7)
    acc = torch.cat([s.commit_lens for s in out.steps])
    assert bool((acc > 1).any()) and bool((acc == 1).any()), "need both accepts and rejects"
    pair = out.tokens[:, 0] * vocab + out.tokens[:, 1]
    counts = torch.bincount(pair.cpu(), minlength=vocab * vocab).double()
    expected = exact * n
    mask = expected > 5
    chi2 = float((((counts - expected) ** 2) / expected)[mask].sum())
    df = int(mask.sum()) - 1
    assert df >= 10, f"too few populated cells ({df + 1}) for a meaningful test"
    assert chi2 < df + 6 * (2 * df) ** 0.5, (chi2, df)
    # the test can fail: the draft's own distribution is far from the target's
    with torch.no_grad():
        h = draft.forward_dense(prompt[None])[0, -1]
        q1 = torch.softmax(draft.propose(h[None], 1, prompt[-1:])[0][0, 0] / temp, -1).double()
    q_counts = torch.bincount(out.tokens[:, 0].cpu(), minlength=vocab).double()
    chi2_q = float(((q_counts - q1 * n) ** 2 / (q1 * n)).sum())
    assert chi2_q > chi2


def test_bad_input(decoder: SpecDecoder) -> None:
    with pytest.raises(ValueError, match="tpu"):
        check_device("tpu")
    with pytest.raises(ValueError, match="meta"):
        check_device(torch.device("meta"))
    with pytest.raises(ValueError, match="unknown verify mode 'fast'"):
        decoder.generate(_prompts(2, 5), 4, FixedK(1), mode="fast")
    with pytest.raises(ValueError, match="KV pages"):
        decoder.generate(_prompts(600, 5), 4, FixedK(1))
    with pytest.raises(ValueError, match="max_seq_len"):
        decoder.generate(_prompts(2, 50), 20, FixedK(1))
    with pytest.raises(ValueError, match="k >= 0"):
        FixedK(-1)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 4\]"):
        decoder.generate(_prompts(2, 5), 4, Oracle(5))
    with pytest.raises(ValueError, match="clock must be one of .* got 'cpu'"):
        SpecDecoder(decoder.target, decoder.draft, cache_tokens=64, clock="cpu")


def test_block_hidden_batches_the_heads_exactly() -> None:
    """The batched draft heads compute what the k head modules compute one by one."""
    torch.manual_seed(2)
    draft = DraftLM(ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=16), 4)
    with torch.no_grad():
        for p in draft.heads.parameters():
            p.normal_()
    for shape, k in (((3, 32), 4), ((2, 5, 32), 2), ((1, 32), 1)):
        h = torch.randn(shape)
        ref = torch.stack([h + head(h) for head in draft.heads[:k]], dim=-2)
        torch.testing.assert_close(draft.block_hidden(h, k), ref, rtol=1e-5, atol=1e-5)


def test_reserve_new_tokens_sizes_the_cache_not_the_output(decoder: SpecDecoder) -> None:
    prompts = _prompts(2, 5)
    ref = decoder.generate(prompts, 6, FixedK(2))
    out = decoder.generate(prompts, 6, FixedK(2), reserve_new_tokens=30)
    assert torch.equal(out.tokens, ref.tokens) and out.tokens.shape == (2, 6)
    small = SpecDecoder(decoder.target, decoder.draft, cache_tokens=32, page_size=8,
                        device=decoder.device)  # 2 x 2 pages of 8
    small.generate(prompts, 6, FixedK(2))  # 5 + 6 + 3 = 14 tokens per request fit
    with pytest.raises(ValueError, match="KV pages"):  # 5 + 30 + 3 = 38 do not: the reservation is real
        small.generate(prompts, 6, FixedK(2), reserve_new_tokens=30)
    with pytest.raises(ValueError, match="reserve_new_tokens must be a positive int"):
        decoder.generate(prompts, 6, FixedK(2), reserve_new_tokens=0)
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len"):
        decoder.generate(prompts, 6, FixedK(2), reserve_new_tokens=100)


def test_sts_recording_carries_the_margin_baseline(decoder: SpecDecoder, tmp_path) -> None:
    from dspark.calibration_metrics import top2_margin
    from dspark.engine.sts import record_and_fit, record_sts

    prompts = _prompts(6, 6, seed=3)
    res = decoder.generate(prompts, 12, FixedK(4), mode="static")
    assert all(s.draft_logits.shape == (s.requests.numel(), 4, 256) for s in res.steps)
    data = record_sts(decoder, prompts, 4, 12, tmp_path / "a")
    assert data.num_rows == sum(s.requests.numel() for s in res.steps)
    want = torch.cat([top2_margin(s.draft_logits.cpu()) for s in res.steps])
    assert bool(torch.isfinite(data.margin).all()) and torch.equal(data.margin, want)
    calib = record_and_fit(decoder, prompts, 4, 12, tmp_path / "b", bootstrap=0)
    assert not [w for w in calib.warnings if "no margin baseline" in w]
    assert all("auroc_margin" in p["cumulative"] for p in calib.metrics["positions"] if p["cumulative"])


def test_greedy_streams_are_the_engines_greedy_tokens(decoder: SpecDecoder) -> None:
    from dspark.engine.streams import greedy_streams

    prompts = _prompts(5, 6, seed=4)
    ref = decoder.generate(prompts, 20, FixedK(0), mode="static").tokens
    streams = greedy_streams(decoder.target, prompts, 20, batch=2)  # odd batch split: 2 + 2 + 1
    assert torch.equal(streams[:, :6], prompts) and torch.equal(streams[:, 6:], ref)
    with pytest.raises(ValueError, match="exceeds the target's max_seq_len"):
        greedy_streams(decoder.target, prompts, 60)
    with pytest.raises(ValueError, match="batch must be a positive int"):
        greedy_streams(decoder.target, prompts, 4, batch=0)


def test_teacher_forced_sts_rows_equal_the_decode_loops(decoder: SpecDecoder, tmp_path) -> None:
    """The fast recorder is engine data: at the decode loop's step boundaries it records the same rows."""
    from dspark.engine.sts import record_sts, record_sts_teacher_forced

    prompts, gamma, n = _prompts(7, 6, seed=5), 4, 20
    loop = record_sts(decoder, prompts, gamma, n, tmp_path / "loop")
    fast = record_sts_teacher_forced(decoder, prompts, gamma, n, tmp_path / "fast", starts="steps", batch=3, rows=2)
    accepted = torch.nan_to_num(loop.labels).sum(1)
    assert 0 < float(accepted.mean()) < gamma  # partial acceptance: labels of both kinds are compared
    order = lambda d: torch.argsort(d.request_ids * 1000 + d.steps)  # noqa: E731
    a, b = loop.select(order(loop)), fast.select(order(fast))
    assert torch.equal(a.request_ids, b.request_ids) and torch.equal(a.steps, b.steps)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.verify_lens, b.verify_lens)
    torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(b.margin, a.margin, atol=1e-4, rtol=0)
    # every start: the decode loop's rows sit at start offset L - P = sum of the earlier commits
    every = record_sts_teacher_forced(decoder, prompts, gamma, n, tmp_path / "all", starts="all", batch=4)
    assert every.num_rows == 7 * n and torch.equal(torch.unique(every.steps), torch.arange(n))
    commits = accepted[order(loop)].long() + 1
    first = torch.cat([torch.tensor([True]), a.request_ids[1:] != a.request_ids[:-1]])
    offset = torch.zeros_like(commits)
    for i in range(1, commits.numel()):
        offset[i] = 0 if first[i] else offset[i - 1] + commits[i - 1]
    at = {(int(r), int(s)): i for i, (r, s) in enumerate(zip(every.request_ids, every.steps))}
    c = every.select(torch.tensor([at[(int(r), int(o))] for r, o in zip(a.request_ids, offset)]))
    assert torch.equal(c.labels, a.labels)
    torch.testing.assert_close(c.logits, a.logits, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="starts must be one of"):
        record_sts_teacher_forced(decoder, prompts, gamma, n, tmp_path / "x", starts="some")
    with pytest.raises(ValueError, match="gamma must be in"):
        record_sts_teacher_forced(decoder, prompts, 5, n, tmp_path / "x")


def test_head_training_rows_label_what_the_recorder_records(decoder: SpecDecoder) -> None:
    from dspark.engine.streams import greedy_streams
    from dspark.engine.sts import block_outcomes
    from dspark.engine.train import head_rows

    p, n, g = 6, 20, decoder.draft.gamma
    streams = greedy_streams(decoder.target, _prompts(6, p, seed=5), n + g - 1)
    _, _, label, mask = head_rows(decoder.draft, streams, p, chunk=4)  # training starts run to the stream end
    _, _, accepted = block_outcomes(decoder.draft, streams, p, g, n)
    assert label.shape == (6 * n, g) and 0 < float(accepted.float().mean()) < g
    # the recorder's accepted drafts = the leading ones of the training label; the mask ends at the first miss
    assert torch.equal(torch.cumprod(label * mask, -1).sum(-1).long(), accepted.flatten())
    assert torch.equal(mask.sum(-1), torch.clamp(accepted.flatten() + 1, max=g))


def test_fit_head_reaches_the_logistic_optimum(decoder: SpecDecoder) -> None:
    import copy
    import math

    from dspark.confidence import confidence_loss
    from dspark.engine.streams import greedy_streams
    from dspark.engine.train import fit_head, head_rows

    draft = copy.deepcopy(decoder.draft)
    streams = greedy_streams(decoder.target, _prompts(12, 6, seed=7), 30)
    hidden, prev, label, mask = head_rows(draft, streams, 6)
    prev = prev if draft.confidence.markov_rank else None
    with torch.no_grad():
        before = float(confidence_loss(draft.confidence(hidden, prev), label, mask, math.inf))
    assert fit_head(draft, streams, 6) < before - 1e-3
    with torch.no_grad():
        p = torch.sigmoid(draft.confidence(hidden, prev))
    # at the optimum the intercept's gradient vanishes: mean predicted = mean label over the trained rows
    assert abs(float(p[mask].mean() - label[mask].mean())) < 1e-3


def test_record_and_fit_with_the_teacher_forced_recorder(decoder: SpecDecoder, tmp_path) -> None:
    from dspark.engine.sts import record_and_fit

    prompts = _prompts(6, 6, seed=3)
    loop = record_and_fit(decoder, prompts, 4, 12, tmp_path / "a", bootstrap=0)
    fast = record_and_fit(decoder, prompts, 4, 12, tmp_path / "b", bootstrap=0, recorder="teacher_forced")
    assert fast.data["rows"] == loop.data["rows"]  # the decode loop's very rows
    assert fast.temperatures == pytest.approx(loop.temperatures, rel=1e-3)
    with pytest.raises(ValueError, match="greedy acceptance only"):
        record_and_fit(decoder, prompts, 4, 12, tmp_path / "c", sampling=True, recorder="teacher_forced")
    with pytest.raises(ValueError, match="recorder must be one of"):
        record_and_fit(decoder, prompts, 4, 12, tmp_path / "c", recorder="fast")
