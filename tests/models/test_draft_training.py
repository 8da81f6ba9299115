"""The draft's training data and objective: prompt kinds, labelled streams and their cache, the distillation
rows, the confidence head's per-position feature terms, and reading a draft file from before the features."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from dspark.calibration.confidence import ConfidenceHead  # noqa: E402
from dspark.calibration.online import draft_features  # noqa: E402
from dspark.models import stream_store  # noqa: E402
from dspark.models.distil import row_labels, step_loss  # noqa: E402
from dspark.models.draft import (  # noqa: E402
    METADATA_KEY,
    DraftConfig,
    DraftModel,
    file_sha256,
    load_draft,
    manifest_path,
)
from dspark.models.draft_file import save_draft  # noqa: E402
from dspark.models.kinds import KINDS, kind_prompts, prose_windows  # noqa: E402
from dspark.models.stream_store import Streams, labelled_streams  # noqa: E402
from dspark.models.train_data import draw_prompts  # noqa: E402
from dspark.models.train_draft import tiny_target  # noqa: E402


def _encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


def _draft(target, gamma: int = 3, vocab: int = 48, features: int = 3) -> DraftModel:
    torch.manual_seed(2)
    cfg = DraftConfig(hidden_size=64, vocab_size=256, draft_vocab_size=vocab, num_q_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=32, chain_size=32, gamma=gamma, markov_rank=2,
                      confidence_features=features, max_seq_len=96)
    return DraftModel(cfg, target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                      torch.randperm(256)[:vocab]).eval()


@pytest.mark.cpu_only(reason="prompt text from the stdlib files: no tensors beyond token ids")
def test_kind_prompts_have_their_template_and_a_fixed_length():
    for kind in KINDS:
        rows = kind_prompts(kind, "heldout", _encode, 12, seed=3, length=300)
        assert rows.shape == (12, 300) and rows.dtype == torch.int64
        text = [bytes(r.tolist()).decode("utf-8", errors="replace") for r in rows]
        if kind == "code":
            assert not any("<|im_start|>" in t for t in text)
        else:
            assert all(t.startswith("<|im_start|>system\n") and t.endswith("<|im_start|>assistant\n" + (
                "```python\n" if kind == "edit" else "")) for t in text)
        assert torch.equal(rows, kind_prompts(kind, "heldout", _encode, 12, seed=3, length=300))
        assert not torch.equal(rows, kind_prompts(kind, "heldout", _encode, 12, seed=4, length=300))
    with pytest.raises(ValueError, match="kind must be one of .* got 'poem'"):
        kind_prompts("poem", "train", _encode, 2, 0)
    with pytest.raises(ValueError, match="split must be one of .* got 'test'"):
        kind_prompts("chat", "test", _encode, 2, 0)
    with pytest.raises(ValueError, match="length=40 leaves fewer than 8 window tokens beside the chat template"):
        kind_prompts("chat", "train", _encode, 2, 0, length=40)


@pytest.mark.cpu_only(reason="prompt draws: token ids only")
def test_prompt_draws_are_prefix_stable_and_prose_splits_are_disjoint():
    small, large = (draw_prompts("code", "calibration", _encode, n, 16, seed=5) for n in (6, 20))
    assert torch.equal(small, large[:6]) and large.unique(dim=0).shape[0] > 15
    windows = {split: {tuple(r) for r in prose_windows(split, _encode, 64, 24, seed=1).tolist()}
               for split in ("train", "calibration", "heldout")}
    assert not windows["train"] & windows["heldout"] and not windows["calibration"] & windows["heldout"]


def test_labelled_streams_label_every_position_with_the_targets_top1(target, device, tmp_path):
    model = target.to(device)
    prompts = torch.randint(3, 256, (5, 7), generator=torch.Generator().manual_seed(0))
    s = labelled_streams(model, prompts.to(device), 6, batch=2)
    assert s.tokens.shape == (5, 13) and s.hidden.shape == (5, 12, 64) and s.argmax.shape == (5, 12)
    with torch.no_grad():
        want = model(input_ids=s.tokens.to(device)).logits[:, :-1].argmax(-1).cpu()
    assert torch.equal(s.argmax, want)  # prompt positions (teacher-forced) and continuation alike
    assert torch.equal(s.argmax[:, 6:], s.tokens[:, 7:]) and torch.equal(s.tokens[:, :7], prompts)


@pytest.mark.cpu_only(reason="the stream cache's files")
def test_the_stream_cache_is_read_back_and_found_as_halves(target, tmp_path, monkeypatch):
    prompts = torch.randint(3, 256, (8, 5), generator=torch.Generator().manual_seed(1))
    first = labelled_streams(target, prompts, 4, batch=4, cache=tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2

    def refuse(*args, **kwargs):
        raise AssertionError("the cache should have answered")

    monkeypatch.setattr(stream_store, "_generate", refuse)
    for batch in (4, 8):  # the batch of 8 is found as the two files of 4
        again = labelled_streams(target, prompts, 4, batch=batch, cache=tmp_path)
        for a, b in ((first.tokens, again.tokens), (first.hidden, again.hidden), (first.argmax, again.argmax)):
            assert torch.equal(a, b)
        assert again.seconds == pytest.approx(first.seconds)
    with pytest.raises(AssertionError, match="cache should have answered"):
        labelled_streams(target, prompts, 5, batch=8, cache=tmp_path)  # another new-token count is another key


@pytest.mark.cpu_only(reason="index bookkeeping of the training rows on host tensors")
@settings(max_examples=15)
@given(n=st.integers(1, 3), t=st.integers(4, 12), g=st.integers(1, 4), seed=st.integers(0, 10**6))
def test_row_labels_and_teacher_match_their_definition(target, n, t, g, seed):
    """Row t >= 1 step j: label = the draft-vocabulary id of argmax[t + j] (-100 past the end or outside the
    vocabulary); teacher[j - 1] = token t + j (0 past the end)."""
    draft = _draft(target, gamma=g, vocab=40)
    gen = torch.Generator().manual_seed(seed)
    s = Streams(torch.randint(0, 256, (n, t), generator=gen), torch.zeros(n, t - 1, 64, dtype=torch.float16),
                torch.randint(0, 256, (n, t - 1), generator=gen), 2, 0.0)
    labels, teacher = row_labels(draft, s)
    assert labels.shape == (n, t - 2, g) and teacher.shape == (n, t - 2, g - 1)
    ids = draft.vocab_ids.tolist()
    for i in range(n):
        for r in range(t - 2):
            row = r + 1
            for j in range(g):
                pos = row + j
                want = ids.index(int(s.argmax[i, pos])) if pos < t - 1 and int(s.argmax[i, pos]) in ids else -100
                assert int(labels[i, r, j]) == want
                if j:  # past the stream's end the input is a filler 0 (its label is -100)
                    assert int(teacher[i, r, j - 1]) == (int(s.tokens[i, pos]) if pos < t else 0)


def test_a_distillation_step_lowers_the_loss_of_its_batch(target, device):
    draft = _draft(target, gamma=3, vocab=256).to(device)
    draft.vocab_ids.copy_(torch.arange(256, device=device))
    prompts = torch.randint(3, 256, (4, 6), generator=torch.Generator().manual_seed(2))
    s = labelled_streams(target.to(device), prompts.to(device), 10, batch=4)
    labels, teacher = row_labels(draft, s)
    batch = (s.tokens.to(device), s.hidden.float().to(device), labels.to(device), teacher.to(device))
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    draft.train()
    losses = []
    for _ in range(8):
        loss, hits = step_loss(draft, *batch, soft_weight=0.5, feature_weight=0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05 and hits.shape == (3,) and bool(((hits >= 0) & (hits <= 1)).all())


@settings(max_examples=10)
@given(g=st.integers(1, 5), k=st.integers(0, 4), seed=st.integers(0, 10**6))
def test_per_position_feature_terms_act_on_their_own_position(device, g, k, seed):
    torch.manual_seed(seed)
    head = ConfidenceHead(10, markov_rank=0, num_features=3, positions=5).to(device)
    x = torch.randn(4, g, 10, device=device)
    base = head(x)
    with torch.no_grad():
        head.position_weight[k].normal_()
        head.position_bias[k] += 1.0
    out = head(x)
    others = [j for j in range(g) if j != k]
    assert torch.equal(out[:, others], base[:, others])
    if k < g:
        want = base[:, k] + 1.0 + (x[:, k, -3:] * head.position_weight[k]).sum(-1)
        torch.testing.assert_close(out[:, k], want)
    with pytest.raises(ValueError, match="gamma=6 positions, the head has per-position terms for 5"):
        head(torch.randn(1, 6, 10, device=device))


def test_the_head_reads_its_distributions_features(target, device):
    draft = _draft(target.to(device), gamma=3).to(device)
    h = torch.randn(4, 64, device=device)
    hk, reduced = draft.chain(h, 3)
    inputs = draft.head_inputs(hk, reduced)
    torch.testing.assert_close(inputs, torch.cat([hk, draft_features(reduced)], -1))
    torch.testing.assert_close(draft.head_inputs(hk), inputs)
    anchor = torch.arange(4, device=device)
    logits, conf = draft.propose(h, 3, anchor)
    torch.testing.assert_close(conf, draft.confidence_logits(hk, anchor, draft.vocab_ids[reduced.argmax(-1)]))
    with torch.no_grad():
        draft.confidence.position_weight.zero_()
        draft.confidence.position_weight[:, 0] = 1.0  # the top-1 log-odds now moves every logit
    moved = draft.confidence_logits(hk, anchor, logits.argmax(-1))
    assert not torch.allclose(moved, conf)
    assert draft_features(reduced)[..., 0].std() > 0


@pytest.mark.cpu_only(reason="weight-file compatibility")
def test_a_draft_file_from_before_the_features_still_loads(target, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    old = _draft(target, features=0)
    out = tmp_path / "old.safetensors"
    save_draft(old, target, out, {})
    with safe_open(str(out), framework="pt") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
    del meta["config"]["confidence_features"]  # as the files written before the field existed
    save_file(load_file(str(out)), str(out), metadata={METADATA_KEY: json.dumps(meta, sort_keys=True)})
    man = json.loads(manifest_path(out).read_text())
    manifest_path(out).write_text(json.dumps({**man, "sha256": file_sha256(out)}))
    loaded = load_draft(target, out)
    assert loaded.cfg.confidence_features == 0 and loaded.confidence.hidden_size == 64
    h = torch.randn(2, 64)
    anchor = torch.tensor([1, 2])
    torch.testing.assert_close(loaded.propose(h, 3, anchor)[1], old.propose(h, 3, anchor)[1], atol=1e-2, rtol=1e-2)


def test_block_rows_are_the_blocks_propose_gives_at_every_start(target, device):
    """conf / accepted per start equal propose on the root's state and a greedy match against the stream; the
    soft proxy is sum_x min(q, p) with p the target's softmax at the draft's position."""
    from dspark.models.draft_eval import block_rows
    from dspark.models.streams import features

    model = target.to(device)
    draft = _draft(model, gamma=3).to(device)
    prompts = torch.randint(3, 256, (3, 6), generator=torch.Generator().manual_seed(4))
    s = labelled_streams(model, prompts.to(device), 9, batch=3)
    rows = block_rows(draft, s, 3, 5, lm_head=model.get_output_embeddings().weight.detach(), chunk=2)
    assert rows["conf"].shape == (3, 5, 3) and rows["accepted"].shape == (3, 5) and rows["soft"].shape == (3, 5, 3)
    hidden = draft.forward_dense(s.tokens, features(s.hidden.float()))
    for i in range(5):
        root = 5 + i                                                     # the row of the last committed token
        logits, conf = draft.propose(hidden[:, root], 3, s.tokens[:, root])
        torch.testing.assert_close(rows["conf"][:, i], conf, atol=1e-5, rtol=1e-4)
        match = (logits.argmax(-1) == s.tokens[:, root + 1: root + 4]).long()
        assert torch.equal(rows["accepted"][:, i], torch.cumprod(match, -1).sum(-1))
        q = torch.softmax(logits[:, 0], -1)
        p = torch.softmax(s.hidden[:, root].float() @ model.get_output_embeddings().weight.t(), -1)
        torch.testing.assert_close(rows["soft"][:, i, 0], torch.minimum(p, q).sum(-1), atol=1e-5, rtol=1e-4)
