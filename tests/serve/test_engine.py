"""Reference engine: losslessness, sampling distribution, bad input (a tiny random Llama target through
transformers' own model code and a briefly distilled draft, short runs)."""
from __future__ import annotations

import pytest
import torch

from dspark.config import VerifyMode
from dspark.models.draft import DraftConfig, DraftModel
from dspark.models.streams import features, greedy_streams
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve.checks import check_device
from dspark.serve.config import EngineConfig, SamplingParams
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import FixedK, Oracle
from tests.engine_models import VOCAB, PartialFixedK, tiny_llama, tiny_models

MODES = [m.value for m in VerifyMode]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def decoder(device) -> SpecDecoder:
    target, draft = tiny_models()
    return SpecDecoder(target, draft, config=EngineConfig(cache_tokens=4096, page_size=8, device=device))


def _prompts(b: int, p: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, p), generator=torch.Generator().manual_seed(seed))


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


def _exact_two_token_dist(target: TransformersCausalLM, prompt: torch.Tensor, temperature: float) -> torch.Tensor:
    """p(t1, t2 | prompt) by enumeration with transformers' own forward: [V, V]."""
    v = target.geometry.vocab_size
    with torch.no_grad(), target.own_attention() as model:
        p1 = torch.softmax(model(prompt[None]).logits[0, -1] / temperature, -1)
        ctx = torch.cat([prompt[None].expand(v, -1), torch.arange(v, device=prompt.device)[:, None]], 1)
        p2 = torch.softmax(model(ctx).logits[:, -1] / temperature, -1)
    return p1[:, None] * p2


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_sampling_matches_target_distribution(mode: str, partial: bool, device: torch.device) -> None:
    """Chi-square of the emitted (t1, t2) pairs against the exact target distribution, on a small vocab; also
    when every other request does not draft and verifies the filler tokens its step lays out for it."""
    vocab, n, temp = 6, 3000, 4.0
    target = TransformersCausalLM(tiny_llama(vocab=vocab, seed=3, embed_std=0.3))
    emb = target.hf_model.get_input_embeddings().weight
    torch.manual_seed(4)  # an untrained draft: both accepts and rejects happen
    draft = DraftModel(DraftConfig(hidden_size=64, vocab_size=vocab, draft_vocab_size=vocab, num_q_heads=4,
                                   num_kv_heads=2, head_dim=16, intermediate_size=32, chain_size=32, gamma=3,
                                   markov_rank=2, max_seq_len=64), emb, emb, torch.arange(vocab)).eval()
    dec = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=n * 16, page_size=8, device=device))
    prompt = torch.tensor([1, 4, 2, 5, 0], device=device)
    exact = _exact_two_token_dist(target, prompt, temp).flatten().double().cpu()
    policy = PartialFixedK(3) if partial else FixedK(3)
    out = dec.generate(prompt[None].expand(n, -1).contiguous(), 2, policy, mode=mode,
                       sampling=SamplingParams(temperature=temp, seed=7))
    acc = torch.cat([s.commit_lens.cpu() for s in out.steps])
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
    with torch.no_grad(), target.own_attention() as model:
        th = model.base_model(prompt[None]).last_hidden_state[:, :-1]
        h = draft.forward_dense(prompt[None], features(th))[0, -1]
        q1 = torch.softmax(draft.propose(h[None], 1, prompt[-1:])[0][0, 0] / temp, -1).double().cpu()
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
    with pytest.raises(TypeError, match="target must be a dspark.models.TransformersCausalLM"):
        SpecDecoder(decoder.target.hf_model, decoder.draft)
    with pytest.raises(TypeError, match="draft must be a dspark.models.DraftModel"):
        SpecDecoder(decoder.target, decoder.target)
    with pytest.raises(ValueError, match="k >= 0"):
        FixedK(-1)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 4\]"):
        decoder.generate(_prompts(2, 5), 4, Oracle(5))
    with pytest.raises(ValueError, match="clock must be one of .* got 'cpu'"):
        SpecDecoder(decoder.target, decoder.draft, config=EngineConfig(cache_tokens=64, clock="cpu"))


def test_reserve_new_tokens_sizes_the_cache_not_the_output(decoder: SpecDecoder) -> None:
    prompts = _prompts(2, 5)
    ref = decoder.generate(prompts, 6, FixedK(2))
    out = decoder.fork(reserve_new_tokens=30).generate(prompts, 6, FixedK(2))
    assert torch.equal(out.tokens, ref.tokens) and out.tokens.shape == (2, 6)
    small = SpecDecoder(decoder.target, decoder.draft, EngineConfig(cache_tokens=32, page_size=8,
                                                                    device=decoder.device))  # 2 x 2 pages of 8
    small.generate(prompts, 6, FixedK(2))  # 5 + 6 + 3 = 14 tokens per request fit
    with pytest.raises(ValueError, match="KV pages"):  # 5 + 30 + 3 = 38 do not: the reservation is real
        small.fork(reserve_new_tokens=30).generate(prompts, 6, FixedK(2))
    with pytest.raises(ValueError, match="reserve_new_tokens must be a positive int"):
        EngineConfig(reserve_new_tokens=0)
    with pytest.raises(ValueError, match="exceeds the TransformersCausalLM's max_seq_len"):
        decoder.fork(reserve_new_tokens=100).generate(prompts, 6, FixedK(2))


def test_draft_logits_are_kept_only_when_asked(decoder: SpecDecoder) -> None:
    """A run keeps no [B, k, V] tensor per step unless asked: at V = 49152 that is 9 MB a step at B = 16."""
    prompts = _prompts(3, 6, seed=4)
    plain = decoder.generate(prompts, 8, FixedK(4))
    kept = decoder.fork(keep_draft_logits=True).generate(prompts, 8, FixedK(4))
    assert torch.equal(plain.tokens, kept.tokens)
    assert plain.steps and all(s.draft_logits is None for s in plain.steps)
    assert all(s.draft_logits.shape == (s.requests.numel(), 4, VOCAB) for s in kept.steps)
    with pytest.raises(TypeError, match="keep_draft_logits must be a bool, got int: 1"):
        EngineConfig(keep_draft_logits=1)


def test_sts_recording_carries_the_margin_baseline(decoder: SpecDecoder, tmp_path) -> None:
    from dspark.calibration.metrics import top2_margin
    from dspark.lab.calibrate import record_and_fit, record_sts

    prompts = _prompts(6, 6, seed=3)
    res = decoder.fork(keep_draft_logits=True).generate(prompts, 12, FixedK(4), mode="static")
    assert all(s.draft_logits.shape == (s.requests.numel(), 4, VOCAB) for s in res.steps)
    data = record_sts(decoder, prompts, 4, 12, tmp_path / "a")
    assert data.num_rows == sum(s.requests.numel() for s in res.steps)
    want = torch.cat([top2_margin(s.draft_logits.cpu()) for s in res.steps])
    assert bool(torch.isfinite(data.margin).all()) and torch.equal(data.margin, want)
    calib = record_and_fit(decoder, prompts, 4, 12, tmp_path / "b", bootstrap=0)
    assert not [w for w in calib.warnings if "no margin baseline" in w]
    assert all("auroc_margin" in p["cumulative"] for p in calib.metrics["positions"] if p["cumulative"])


def test_greedy_streams_are_the_engines_greedy_tokens(decoder: SpecDecoder) -> None:
    prompts = _prompts(5, 6, seed=4)
    ref = decoder.generate(prompts, 20, FixedK(0), mode="static").tokens
    with decoder.target.own_attention() as model:
        streams, hidden = greedy_streams(model, prompts, 20, batch=2)  # odd batch split: 2 + 2 + 1
        with pytest.raises(ValueError, match="exceeds the target's max_seq_len"):
            greedy_streams(model, prompts, 60)
        with pytest.raises(ValueError, match="batch must be an int >= 1"):
            greedy_streams(model, prompts, 4, batch=0)
    assert torch.equal(streams[:, :6], prompts) and torch.equal(streams[:, 6:], ref)
    assert hidden.shape == (5, 25, decoder.target.geometry.hidden_size) and bool(hidden.abs().sum(-1).gt(0).all())
    # the hidden states are the target's own on the stream: its LM head gives back the greedy tokens
    assert torch.equal(decoder.target.logits(hidden[:, 5:].flatten(0, 1)).argmax(-1).view(5, 20), streams[:, 6:])


def test_teacher_forced_sts_rows_equal_the_decode_loops(decoder: SpecDecoder, tmp_path) -> None:
    """The fast recorder is engine data: at the decode loop's step boundaries it records the same rows."""
    from dspark.lab.calibrate import TeacherForcing, record_sts, record_sts_teacher_forced

    prompts, gamma, n = _prompts(7, 6, seed=5), 4, 20
    loop = record_sts(decoder, prompts, gamma, n, tmp_path / "loop")
    fast = record_sts_teacher_forced(decoder, prompts, gamma, n, tmp_path / "fast",
                                     forcing=TeacherForcing(starts="steps", batch=3, rows=2))
    accepted = torch.nan_to_num(loop.labels).sum(1)
    assert 0 < float(accepted.mean()) < gamma  # partial acceptance: labels of both kinds are compared
    order = lambda d: torch.argsort(d.request_ids * 1000 + d.steps)  # noqa: E731
    a, b = loop.select(order(loop)), fast.select(order(fast))
    assert torch.equal(a.request_ids, b.request_ids) and torch.equal(a.steps, b.steps)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.verify_lens, b.verify_lens)
    torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(b.margin, a.margin, atol=1e-4, rtol=0)
    # every start: the decode loop's rows sit at start offset L - P = sum of the earlier commits
    every = record_sts_teacher_forced(decoder, prompts, gamma, n, tmp_path / "all",
                                      forcing=TeacherForcing(starts="all", batch=4))
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
        TeacherForcing(starts="some")
    with pytest.raises(ValueError, match="rows must be an int >= 1, got 0"):
        TeacherForcing(rows=0)
    with pytest.raises(ValueError, match="gamma must be in"):
        record_sts_teacher_forced(decoder, prompts, 5, n, tmp_path / "x")


def test_head_training_rows_label_what_the_recorder_records(decoder: SpecDecoder) -> None:
    from dspark.lab.calibrate import block_outcomes
    from dspark.models.confidence_fit import stream_rows

    p, n, g = 6, 20, decoder.draft.gamma
    with decoder.target.own_attention() as model:
        streams, hidden = greedy_streams(model, _prompts(6, p, seed=5), n + g - 1)
    _, _, label, mask = stream_rows(decoder.draft, streams, hidden, p, chunk=4)  # starts run to the stream end
    _, _, accepted = block_outcomes(decoder.draft, streams, hidden, p, g, n)
    assert label.shape == (6 * n, g) and 0 < float(accepted.float().mean()) < g
    # the recorder's accepted drafts = the leading ones of the training label; the mask ends at the first miss
    assert torch.equal(torch.cumprod(label * mask, -1).sum(-1).long(), accepted.flatten())
    assert torch.equal(mask.sum(-1), torch.clamp(accepted.flatten() + 1, max=g))


def test_fit_head_reaches_the_logistic_optimum(decoder: SpecDecoder) -> None:
    import copy
    import math

    from dspark.calibration.confidence import confidence_loss
    from dspark.models.confidence_fit import fit_confidence, stream_rows

    draft = copy.deepcopy(decoder.draft)
    with torch.no_grad():
        draft.confidence.proj.weight.normal_()  # away from the fitted optimum
    with decoder.target.own_attention() as model:
        streams, target_hidden = greedy_streams(model, _prompts(12, 6, seed=7), 30)
    rows = stream_rows(draft, streams, target_hidden, 6)
    hidden, prev, label, mask = rows
    prev = prev if draft.confidence.markov_rank else None
    with torch.no_grad():
        before = float(confidence_loss(draft.confidence(hidden, prev), label, mask, math.inf))
    assert fit_confidence(draft, rows, 1000) < before - 1e-3
    with torch.no_grad():
        p = torch.sigmoid(draft.confidence(hidden, prev))
    # at the optimum the intercept's gradient vanishes: mean predicted = mean label over the trained rows
    assert abs(float(p[mask].mean() - label[mask].mean())) < 1e-3


def test_record_and_fit_with_the_teacher_forced_recorder(decoder: SpecDecoder, tmp_path) -> None:
    from dspark.lab.calibrate import StsRecording, record_and_fit

    prompts = _prompts(6, 6, seed=3)
    loop = record_and_fit(decoder, prompts, 4, 12, tmp_path / "a", bootstrap=0)
    fast = record_and_fit(decoder, prompts, 4, 12, tmp_path / "b", bootstrap=0,
                          recording=StsRecording(recorder="teacher_forced"))
    assert fast.data["rows"] == loop.data["rows"]  # the decode loop's very rows
    assert fast.temperatures == pytest.approx(loop.temperatures, rel=1e-3)
    with pytest.raises(ValueError, match="greedy acceptance only"):
        StsRecording(SamplingParams(1.0), recorder="teacher_forced")
    with pytest.raises(ValueError, match="recorder must be one of"):
        StsRecording(recorder="fast")
