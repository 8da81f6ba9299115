"""The draft for a transformers target (dspark.models.draft) and its training command (tiny target)."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from dspark.models.corpus import SPLITS, TRAIN_PACKAGES, stdlib_files  # noqa: E402
from dspark.models.draft import (  # noqa: E402
    DEFAULT_WEIGHTS,
    DraftConfig,
    DraftModel,
    load_draft,
    manifest_path,
)
from dspark.models.paged_attend import PagedAttend  # noqa: E402
from dspark.models.train_draft import main, tiny_target  # noqa: E402
from dspark.serve.kv_cache import PagedKVCache  # noqa: E402
from dspark.verify.attention import AttentionShape, RaggedVerifyAttention  # noqa: E402
from dspark.verify.layout import RaggedVerifyLayout  # noqa: E402


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def device_target(device):
    return tiny_target(0).to(device)


def _draft(target, gamma: int = 4, markov_rank: int = 4) -> DraftModel:
    torch.manual_seed(1)
    emb = target.get_input_embeddings().weight
    cfg = DraftConfig(hidden_size=64, vocab_size=256, draft_vocab_size=40, num_q_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=48, chain_size=32, gamma=gamma, markov_rank=markov_rank,
                      max_seq_len=64)
    vocab_ids = torch.randperm(256)[:40].to(emb.device)
    model = DraftModel(cfg, emb, target.get_output_embeddings().weight, vocab_ids).eval()
    with torch.no_grad():  # non-zero chain position biases, so every parameter matters
        model.chain_pos.normal_()
    return model


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, target):
    out = tmp_path_factory.mktemp("draft") / "tiny.safetensors"
    return out, main(["--tiny", "--out", str(out), "--steps", "12"])


def test_a_training_run_computes_on_the_device_under_test(tmp_path, device):
    """`--device`: target, draft and head stage run on the device, the file loads for a host copy of the
    target, and the manifest names where the run computed."""
    out = tmp_path / "dev.safetensors"
    man = main(["--tiny", "--device", str(device), "--out", str(out), "--steps", "3"])
    assert man["device"] == "cpu" if device.type == "cpu" else man["device"].startswith(f"{device.type}: ")
    on_device = load_draft(tiny_target().to(device), out)
    assert {t.device.type for t in (*on_device.parameters(), *on_device.buffers())} == {device.type}
    host = load_draft(tiny_target(), out)
    acc = man["heldout_acceptance"]
    assert acc["starts"] > 0 and 0 <= acc["rate"][0] <= 1
    for (name, a), b in zip(on_device.state_dict().items(), host.state_dict().values()):
        assert torch.equal(a.cpu(), b), name


def test_packed_forward_over_paged_cache_equals_dense(device_target, device):
    target = device_target
    """Two requests in two forwards (a prefill, then ragged rows) through `PagedAttend` (the engine's
    attention) over a paged cache give the dense causal path's hidden states."""
    draft = _draft(target)
    g = draft.geometry
    gen = torch.Generator().manual_seed(0)
    lens, first = [9, 6], [5, 2]
    tokens = [torch.randint(0, 256, (n,), generator=gen).to(device) for n in lens]
    feats = [torch.randn(n, 64, generator=gen).to(device) for n in lens]
    dense = [draft.forward_dense(t[None], f[None])[0] for t, f in zip(tokens, feats)]
    cache = PagedKVCache(num_layers=g.num_layers, num_heads=g.num_kv_heads, head_dim=g.head_dim, num_pages=8,
                         page_size=4, device=device)
    table = cache.admit(2, 12)
    attn = RaggedVerifyAttention(AttentionShape(32, 3, int(table.shape[1]), g.num_q_heads, g.num_kv_heads, g.head_dim,
                                                4, sm_scale=g.sm_scale, num_pages=8), device, torch.float32)
    for lo, hi in ((lambda i: 0, lambda i: first[i]), (lambda i: first[i], lambda i: lens[i])):
        spans = [(lo(i), hi(i)) for i in range(2)]
        layout = RaggedVerifyLayout.from_verify_lens(torch.tensor([b - a for a, b in spans], dtype=torch.int32,
                                                                  device=device))
        prefix = torch.tensor([a for a, _ in spans], dtype=torch.int32, device=device)
        step = PagedAttend(attn, cache.k, cache.v, layout, prefix, table)
        rows = torch.cat([tokens[i][a:b] for i, (a, b) in enumerate(spans)])
        out = draft(rows, step.positions, torch.cat([feats[i][a:b] for i, (a, b) in enumerate(spans)]), step)
        want = torch.cat([dense[i][a:b] for i, (a, b) in enumerate(spans)])
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_logits_live_on_the_draft_vocabulary(device_target, device):
    target = device_target
    draft = _draft(target)
    hk = draft.block_hidden(torch.randn(3, 64, device=device), 4)
    logits = draft.logits(hk)
    assert logits.shape == (3, 4, 256) and hk.shape == (3, 4, 64)
    outside = torch.ones(256, dtype=torch.bool, device=device)
    outside[draft.vocab_ids] = False
    assert torch.isneginf(logits[..., outside]).all() and torch.isfinite(logits[..., ~outside]).all()
    assert torch.isin(logits.argmax(-1), draft.vocab_ids).all()
    props, _ = draft.propose(torch.randn(3, 64, device=device), 4, torch.tensor([1, 2, 3], device=device))
    assert props.shape == (3, 4, 256)


def test_greedy_chain_feeds_each_step_the_previous_argmax(device_target, device):
    target = device_target
    """block_hidden's step j reads draft j - 1 = argmax of step j - 1: teacher-forcing those drafts gives
    the same states, and propose's logits are logits(block_hidden)."""
    draft = _draft(target)
    h, anchor = torch.randn(5, 64, device=device), torch.randint(0, 256, (5,), device=device)
    hk = draft.block_hidden(h, 4)
    drafts = draft.logits(hk).argmax(-1)
    torch.testing.assert_close(draft.chain(h, 4, drafts[:, :-1])[0], hk)
    logits, conf = draft.propose(h, 4, anchor)
    torch.testing.assert_close(logits, draft.logits(hk))
    torch.testing.assert_close(conf, draft.confidence_logits(hk, anchor, drafts))
    _, reduced = draft.chain(h, 4)
    torch.testing.assert_close(conf, draft.confidence_logits(hk, anchor, drafts, reduced))  # the chain's logits reused
    assert draft.block_hidden(h, 0).shape == (5, 0, 64)
    with pytest.raises(ValueError, match="k=5 exceeds gamma=4"):
        draft.block_hidden(h, 5)


def test_confidence_of_a_draft_ignores_its_own_token(device_target, device):
    target = device_target
    draft = _draft(target)
    with torch.no_grad():
        draft.confidence.embed.weight.normal_()
    hk, anchor = torch.randn(2, 4, 64, device=device), torch.tensor([7, 9], device=device)
    drafts = torch.randint(0, 256, (2, 4), device=device)
    base = draft.confidence_logits(hk, anchor, drafts)
    for k in range(4):
        other = drafts.clone()
        other[:, k] = (other[:, k] + 1) % 256
        conf = draft.confidence_logits(hk, anchor, other)
        torch.testing.assert_close(conf[:, : k + 1], base[:, : k + 1])  # draft k and earlier unchanged
        if k < 3:
            assert not torch.equal(conf[:, k + 1], base[:, k + 1])  # draft k + 1 sees it (previous token)
    assert not torch.equal(draft.confidence_logits(hk, torch.tensor([8, 9], device=device), drafts)[:, 0], base[:, 0])


@pytest.mark.cpu_only(reason="the training command and its weight files, on the CPU")
def test_tiny_training_run_writes_a_loadable_draft(tiny_run, target):
    out, manifest = tiny_run
    on_disk = json.loads(manifest_path(out).read_text())
    assert on_disk == manifest and len(on_disk["heldout_acceptance"]["rate"]) == on_disk["training"]["gamma"]
    assert set(on_disk["wall_s"]) >= {"target_streams", "distil", "confidence_head", "total"}
    assert not list(out.parent.glob("*.tmp"))
    draft = load_draft(target, out)
    logits, conf = draft.propose(torch.randn(2, 64), draft.gamma, torch.tensor([3, 4]))
    assert logits.shape == (2, draft.gamma, 256) and torch.isfinite(conf).all()
    assert on_disk["confidence_head"]["split"] == "calibration"
    again = main(["--tiny", "--out", str(out.parent / "again.safetensors"), "--steps", "12"])
    assert again["sha256"] == manifest["sha256"]  # seeded: the same run writes the same bytes


@pytest.mark.cpu_only(reason="the training command and its weight files, on the CPU")
def test_refit_head_reproduces_the_full_run(tiny_run, tmp_path):
    """--refit-head on a full run's file regenerates the head streams and refits to the same bytes; a
    changed head option changes the head only; a non-head option is refused."""
    out, manifest = tiny_run
    copy = tmp_path / "refit.safetensors"
    shutil.copy(out, copy)
    shutil.copy(manifest_path(out), manifest_path(copy))
    refit = main(["--tiny", "--out", str(copy), "--refit-head"])
    assert refit["sha256"] == manifest["sha256"] and refit["head_refit"]["from_sha256"] == manifest["sha256"]
    assert refit["wall_s"]["distil"] == manifest["wall_s"]["distil"]
    other = main(["--tiny", "--out", str(copy), "--refit-head", "--head-l2", "0.1"])
    assert other["sha256"] != manifest["sha256"] and other["training"]["head_l2"] == 0.1
    assert other["heldout_acceptance"] == manifest["heldout_acceptance"]  # the draft itself is untouched
    with pytest.raises(SystemExit):
        main(["--tiny", "--out", str(copy), "--refit-head", "--steps", "3"])
    with pytest.raises(SystemExit):
        main(["--tiny", "--out", str(tmp_path / "none.safetensors"), "--refit-head"])


@pytest.mark.cpu_only(reason="the training command and its weight files, on the CPU")
def test_a_run_from_an_init_file_keeps_its_body_with_steps_0(tiny_run, target, tmp_path):
    """--init F --steps 0: F's vocabulary and body, a head refitted from the seed; distillation from F changes
    the body; --steps 0 without --init is refused."""
    from safetensors.torch import load_file

    out, manifest = tiny_run
    kept = main(["--tiny", "--out", str(tmp_path / "kept.safetensors"), "--init", str(out), "--steps", "0"])
    assert kept["init"]["sha256"] == manifest["sha256"] and kept["training"]["steps"] == 0
    assert kept["heldout_acceptance"] == manifest["heldout_acceptance"]  # the same body on the same streams
    old, new = load_file(str(out)), load_file(str(tmp_path / "kept.safetensors"))
    assert all(torch.equal(old[k], new[k]) for k in old if not k.startswith("confidence."))
    tuned = main(["--tiny", "--out", str(tmp_path / "tuned.safetensors"), "--init", str(out), "--steps", "3"])
    assert torch.equal(load_draft(target, tmp_path / "tuned.safetensors").vocab_ids, load_draft(target, out).vocab_ids)
    assert not torch.equal(load_file(str(tmp_path / "tuned.safetensors"))["fuse.weight"], old["fuse.weight"])
    assert tuned["wall_s"]["total_with_init"] > tuned["wall_s"]["total"]
    chained = main(["--tiny", "--out", str(tmp_path / "chained.safetensors"), "--init",
                    str(tmp_path / "tuned.safetensors"), "--steps", "0"])
    assert chained["init"]["wall_s"] == tuned["wall_s"]["total_with_init"]  # the whole chain's training time
    with pytest.raises(SystemExit):
        main(["--tiny", "--out", str(tmp_path / "none.safetensors"), "--steps", "0"])


@pytest.mark.cpu_only(reason="file lists: no tensors")
def test_corpus_splits_partition_the_stdlib_files():
    """train, calibration and heldout are disjoint and cover every top-level file; calibration and heldout
    alternate over the every-tenth top-level files the draft never trains on; train adds the package files."""
    files = {s: stdlib_files(s) for s in SPLITS}
    root = files["heldout"][0].parent
    names = [f for s in SPLITS for f in files[s]]
    assert len(names) == len(set(names))
    assert sorted(f for f in names if f.parent == root) == sorted(root.glob("*.py"))
    package_files = [f for f in files["train"] if f.parent != root]
    assert {f.relative_to(root).parts[0] for f in package_files} == set(TRAIN_PACKAGES)
    assert not any(part in ("test", "tests") for f in package_files for part in f.relative_to(root).parts)
    assert all(f.parent == root for s in ("calibration", "heldout") for f in files[s])
    assert files["calibration"] and files["heldout"]
    assert abs(len(files["calibration"]) - len(files["heldout"])) <= 1
    with pytest.raises(ValueError, match="split must be one of .* got 'test'"):
        stdlib_files("test")


@pytest.mark.cpu_only(reason="weight-file integrity checks")
def test_load_checks_hash_presence_and_target(tiny_run, target, tmp_path):
    out, manifest = tiny_run
    with pytest.raises(FileNotFoundError, match="missing.safetensors is missing"):
        load_draft(target, tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    data = bytearray(out.read_bytes())
    data[-1] ^= 1
    bad.write_bytes(bytes(data))
    manifest_path(bad).write_text(manifest_path(out).read_text())
    with pytest.raises(ValueError, match=f"{bad}.*sha256 [0-9a-f]{{64}}.*says {manifest['sha256']}"):
        load_draft(target, bad)
    with pytest.raises(ValueError, match="trained for another target: embed_probe"):
        load_draft(tiny_target(1), out)


@pytest.mark.cpu_only(reason="config validation: no tensors")
def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="draft_vocab_size=300 exceeds vocab_size=256"):
        DraftConfig(hidden_size=64, vocab_size=256, draft_vocab_size=300)
    with pytest.raises(ValueError, match="gamma must be an int >= 1, got 0"):
        DraftConfig(hidden_size=64, vocab_size=256, draft_vocab_size=16, gamma=0)


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    from dspark.models import load_smollm2

    return load_smollm2()[0]


@pytest.mark.cpu_only(reason="the shipped weight file's hash and target check; its forward runs in the engine tests")
def test_shipped_weights_load_for_smollm2(smollm2):
    """The shipped file's sha256 matches its manifest and it was trained for this target."""
    if not DEFAULT_WEIGHTS.is_file():
        pytest.fail(f"shipped draft weights {DEFAULT_WEIGHTS} are missing")
    draft = load_draft(smollm2)
    assert draft.gamma == 6 and draft.geometry.num_layers == 1 and draft.cfg.confidence_features == 3
    assert (draft.geometry.num_q_heads, draft.geometry.num_kv_heads, draft.geometry.head_dim) == (9, 3, 64)
    logits, conf = draft.propose(torch.randn(1, 576), 6, torch.tensor([1]))
    assert logits.shape == (1, 6, 49152) and not math.isnan(float(conf.sum()))
