"""Policy-lab traces: the recorder reproduces what the live engine computes step by step (confidence logits,
estimator features, accepted drafts), a trace survives a save / load round trip, `load_trace` refuses
another draft's trace and every kind of corrupt file, the vectorised lookups equal per-position ones, the
workload is seeded, and the shipped trace loads with the shipped draft."""
from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dspark.calibration.online import draft_features
from dspark.lab.replay import record
from dspark.lab.replay.record import RecordSettings, record_trace
from dspark.lab.replay.trace import (
    DEFAULT_TRACE,
    NEAR_TIE,
    RECORD,
    STORED,
    Trace,
    load_trace,
    manifest_path,
    save_trace,
)
from dspark.lab.replay.workload import KINDS, RENAME, Request, WorkloadSpec, build_workload
from dspark.models.draft import DEFAULT_WEIGHTS, file_sha256
from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import FixedK
from tests.engine_models import VOCAB, tiny_models

pytestmark = pytest.mark.usefixtures("one_thread")
GAMMA = 4
SHA = hashlib.sha256(b"the tiny test draft").hexdigest()
HOST = "trace files, lookups and workloads on the host"


def _requests(seed: int, n: int = 10) -> list[Request]:
    """Tiny-model requests of varied prompt and output lengths."""
    g = torch.Generator().manual_seed(seed)
    return [Request(KINDS[i % 3], torch.randint(3, VOCAB, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g),
                    int(torch.randint(3, 24, (1,), generator=g))) for i in range(n)]


@functools.lru_cache(maxsize=None)
def _recorded(seed: int = 0) -> Trace:
    return record_trace(*tiny_models(gamma=GAMMA), _requests(seed), draft_sha256=SHA,
                        settings=RecordSettings(max_batch=4), meta={"command": f"{RECORD} --tiny"})


def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "t.safetensors"
    save_trace(_recorded(), path)
    return path


# -- the recorder against the live engine ---------------------------------------------------------------
@pytest.mark.parametrize("max_batch", [None, 3])
def test_the_live_engine_computes_the_trace_at_every_step(device, max_batch) -> None:
    target, draft = tiny_models(gamma=GAMMA)
    requests = _requests(0)
    trace = record_trace(target, draft, requests, draft_sha256=SHA, settings=RecordSettings(max_batch=4, device=device))
    assert trace.meta["argmax_mismatches"]["count"] == 0  # teacher-forced argmax = the decoded continuation
    config = EngineConfig(cache_tokens=4096, page_size=8, device=device, keep_draft_logits=True)
    live = SpecDecoder(target, draft, config).generate([r.prompt for r in requests], trace.new_tokens.clone(),
                                                       FixedK(GAMMA), mode="compact", max_batch=max_batch)
    t = torch.zeros(trace.num_requests, dtype=torch.int64)
    differ = near_ties = 0
    for step in live.steps:
        ids = step.owners
        block = trace.block(ids, t[ids])
        torch.testing.assert_close(step.confidence_logits.cpu(), block.confidence_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(draft_features(step.draft_logits).cpu(), block.features, atol=1e-4, rtol=1e-4)
        assert bool((step.caps == GAMMA + 1).all())  # every draft verified: correct_lens is a(t) itself
        bad = step.correct_lens.cpu().to(torch.int64) != block.accepted
        differ += int(bad.sum())
        near_ties += int((trace.margin_block(ids, t[ids], GAMMA + 1) < NEAR_TIE).any(1)[bad].sum())
        t[ids] += step.commit_lens.cpu().to(torch.int64)
    assert differ == near_ties == 0
    assert bool((t >= trace.new_tokens).all())
    for i, n in enumerate(trace.new_tokens.tolist()):
        assert torch.equal(live.tokens[i, :n].cpu(), trace.greedy(i, 0, n))


def test_soft_is_the_overlap_of_the_target_and_draft_distributions(device) -> None:
    target, draft = tiny_models(gamma=GAMMA)
    trace = _recorded()
    hf = target.hf_model
    for i, t in ((0, 0), (3, 2), (7, 5)):
        prefix = torch.cat([trace.prompt(i), trace.greedy(i, 0, t)])
        block = trace.position(i, t)
        with target.own_attention(), torch.no_grad():
            h = hf.base_model(input_ids=prefix[None].to(hf.device)).last_hidden_state[0, -1:]
            x = draft.forward_dense(prefix[None].to(hf.device),
                                    torch.nn.functional.pad(hf.base_model(input_ids=prefix[None, :-1].to(hf.device))
                                                            .last_hidden_state, (0, 0, 1, 0)))[0, -1]
            p = torch.softmax(target.logits(h)[0].float(), -1).cpu()
            q = torch.softmax(draft.logits(draft.chain(x, 1)[0])[0].float(), -1).cpu()
        assert float(torch.minimum(p, q).sum()) == pytest.approx(float(block.soft[0]), abs=2e-3)


@pytest.mark.cpu_only(reason=HOST)
def test_record_is_deterministic_per_seed(tmp_path: Path) -> None:
    target, draft = tiny_models(gamma=GAMMA)
    shas = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        path = tmp_path / f"{name}.safetensors"
        save_trace(record_trace(target, draft, _requests(seed), draft_sha256=SHA, settings=RecordSettings(max_batch=4)),
                   path)
        shas.append(file_sha256(path))
    assert shas[0] == shas[1] != shas[2]


# -- files ----------------------------------------------------------------------------------------------
@pytest.mark.cpu_only(reason=HOST)
def test_save_load_round_trip(tmp_path: Path) -> None:
    trace = _recorded()
    path = _saved(tmp_path)
    back = load_trace(path, draft_sha256=SHA)
    for name in STORED:
        assert torch.equal(getattr(back, name), getattr(trace, name)), name
    assert (back.gamma, back.vocab_size, back.kinds) == (trace.gamma, trace.vocab_size, trace.kinds)
    manifest = json.loads(manifest_path(path).read_text())
    assert back.meta == {**trace.meta, "sha256": manifest["sha256"]} and manifest["sha256"] == file_sha256(path)
    assert manifest["summary"] == json.loads(json.dumps(trace.summary()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.safetensors"]  # no temp files left


@pytest.mark.cpu_only(reason=HOST)
def test_load_refuses_a_trace_of_another_draft(tmp_path: Path) -> None:
    other = hashlib.sha256(b"another draft").hexdigest()
    with pytest.raises(ValueError, match=f"(?s){SHA}.*draft_sha256 is {other}.*{re.escape(RECORD)}"):
        load_trace(_saved(tmp_path), draft_sha256=other)


@pytest.mark.cpu_only(reason=HOST)
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_load_refuses_a_corrupt_or_truncated_file(tmp_path: Path, damage: str) -> None:
    path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        del data[-100:]
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"(?s)corrupt.*sha256 {file_sha256(path)}.*{re.escape(RECORD)} --tiny"):
        load_trace(path)


def _drop(t: dict, key: str) -> None:
    del t[key]


def _bump(t: dict, key: str, index: int, value: int) -> None:
    t[key] = t[key].clone()
    t[key][index] = value


TAMPER = {  # (change to the stored tensors, what the refusal names)
    "missing key": (lambda t: _drop(t, "accepted"), r"keys \['accepted'\] are missing"),
    "offsets": (lambda t: _bump(t, "position_offsets", -1, int(t["position_offsets"][-1]) + 1),
                r"position_offsets add up to"),
    "accepted > gamma": (lambda t: _bump(t, "accepted", 0, GAMMA + 1), rf"accepted\[0\] \(request 0, position 0\) = 5 "
                                                                       rf"is outside \[0, {GAMMA}\]"),
    "accepted vs drafts": (lambda t: _bump(t, "accepted", 0, (int(t["accepted"][0]) + 1) % (GAMMA + 1)),
                           r"accepted\[0\] .* but its drafts match"),
    "token id": (lambda t: _bump(t, "continuation", 2, VOCAB), rf"continuation\[2\] = {VOCAB} is outside"),
    "dtype": (lambda t: t.update(soft=t["soft"].float()), r"soft is stored as torch.float32"),
}


@pytest.mark.cpu_only(reason=HOST)
@pytest.mark.parametrize("case", sorted(TAMPER))
def test_load_refuses_a_file_whose_contents_do_not_add_up(tmp_path: Path, case: str) -> None:
    """A file that passes the sha256 check (its manifest rewritten to match) but holds inconsistent tensors."""
    from safetensors.torch import load_file, save_file

    path = _saved(tmp_path)
    tensors = load_file(str(path))
    change, message = TAMPER[case]
    change(tensors)
    save_file(tensors, str(path))
    man = manifest_path(path)
    manifest = json.loads(man.read_text())
    man.write_text(json.dumps({**manifest, "sha256": file_sha256(path)}))
    with pytest.raises(ValueError, match=f"(?s)corrupt.*{message}.*{re.escape(RECORD)} --tiny"):
        load_trace(path)


@pytest.mark.cpu_only(reason=HOST)
def test_load_refuses_missing_files_and_other_paths(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    with pytest.raises(ValueError, match="path must name a .safetensors file"):
        load_trace(tmp_path / "t.json")
    manifest_path(path).unlink()
    with pytest.raises(FileNotFoundError, match=f"trace manifest .* is missing.*{re.escape(RECORD)}"):
        load_trace(path)
    with pytest.raises(FileNotFoundError, match="trace file"):
        load_trace(tmp_path / "none.safetensors")


# -- lookups --------------------------------------------------------------------------------------------
@pytest.mark.cpu_only(reason=HOST)
@given(picks=st.lists(st.tuples(st.integers(0, 9), st.floats(0, 0.999)), min_size=1, max_size=12),
       width=st.integers(1, GAMMA + 1))
def test_block_equals_per_position_lookups(picks, width) -> None:
    trace = _recorded()
    req = torch.tensor([i for i, _ in picks])
    t = torch.tensor([int(f * int(trace.new_tokens[i])) for i, f in picks])
    block = trace.block(req, t)
    tokens, margins = trace.greedy_block(req, t, width), trace.margin_block(req, t, width)
    for b, (i, pos) in enumerate(zip(req.tolist(), t.tolist())):
        one = trace.position(i, pos)
        for name, value in one._asdict().items():
            assert torch.equal(getattr(block, name)[b], value), name
        assert torch.equal(tokens[b], trace.greedy(i, pos, width))
        assert torch.equal(margins[b], trace.margins(i)[pos: pos + width])
        assert int(one.accepted) == int(torch.cumprod((one.drafts == trace.greedy(i, pos, GAMMA)).long(), 0).sum())


@pytest.mark.cpu_only(reason=HOST)
def test_lookups_refuse_positions_outside_a_request() -> None:
    trace = _recorded()
    n = int(trace.new_tokens[2])
    with pytest.raises(ValueError, match=rf"t\[1\] = {n} for request 2 is outside \[0, N_i = {n}\)"):
        trace.block(torch.tensor([0, 2]), torch.tensor([0, n]))
    with pytest.raises(ValueError, match=rf"requests\[0\] = {trace.num_requests} is outside"):
        trace.block(torch.tensor([trace.num_requests]), torch.tensor([0]))
    with pytest.raises(ValueError, match="exceeds request 2's recorded continuation"):
        trace.greedy(2, n, GAMMA + 1)
    with pytest.raises(ValueError, match=r"t\[0\] .* t \+ width <= N_i \+ gamma"):
        trace.greedy_block(torch.tensor([2]), torch.tensor([n]), GAMMA + 1)
    with pytest.raises(ValueError, match="request must be in"):
        trace.prompt(trace.num_requests)


# -- the workload ---------------------------------------------------------------------------------------
class CharTokenizer:
    """A character-level stand-in for the target's tokenizer (ids are code points; a minimal chat template)."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids) -> str:
        return "".join(map(chr, ids))

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True) -> str:
        return "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + "<assistant>"


@pytest.mark.cpu_only(reason=HOST)
def test_the_workload_mixes_three_kinds_from_one_seed() -> None:
    tok, spec = CharTokenizer(), WorkloadSpec(requests=60, seed=3)
    reqs = build_workload(tok, spec)
    again, other = build_workload(tok, spec), build_workload(tok, WorkloadSpec(requests=60, seed=4))
    key = lambda rs: [(r.kind, r.prompt.tolist(), r.max_new_tokens) for r in rs]  # noqa: E731
    assert key(reqs) == key(again) != key(other)
    assert sorted(r.kind for r in reqs) == sorted(KINDS * 20) and [r.kind for r in reqs[:6]] != list(KINDS * 2)
    assert all(spec.min_new_tokens <= r.max_new_tokens <= spec.max_new_tokens for r in reqs)
    for r in reqs:
        text = tok.decode(r.prompt.tolist())
        if r.kind == "code":
            assert spec.min_prompt_len <= r.prompt.numel() <= spec.max_prompt_len and "<user>" not in text
            continue
        assert text.startswith("<user>") and text.endswith("```</><assistant>")
        snippet = text.split("```python\n")[1].rsplit("\n```")[0]
        assert spec.min_snippet_len <= len(snippet) <= spec.max_snippet_len
        renamed = re.match(re.escape(RENAME).replace(r"\{old\}", "(.+)").replace(r"\{new\}", ".+"),
                           text[len("<user>"):])
        if renamed:
            assert r.kind == "copy" and re.search(rf"\b{re.escape(renamed.group(1))}\b", snippet)


@pytest.mark.cpu_only(reason=HOST)
@pytest.mark.parametrize("field, value", [("requests", 0), ("min_prompt_len", 2), ("max_snippet_len", 5),
                                          ("mean_new_tokens", 8), ("max_new_tokens", 63)])
def test_the_workload_spec_names_a_bad_value(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"{field} must be an int >= \d+, got {value}"):
        WorkloadSpec(**{field: value})


@pytest.mark.cpu_only(reason="command-line parsing before any model loads")
@pytest.mark.parametrize("args, option", [(["--requests", "2"], "--requests"), (["--seed", "-1"], "--seed"),
                                          (["--out", "trace.txt"], "--out"), (["--max-batch", "0"], "--max-batch")])
def test_the_record_command_checks_its_options_first(args: list[str], option: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        record.main(args)
    assert exit_.value.code == 2 and f"argument {option}" in capsys.readouterr().err


# -- the shipped trace ----------------------------------------------------------------------------------
def trace_draft() -> str:
    return json.loads(DEFAULT_TRACE.with_suffix(".json").read_text())["meta"]["draft_sha256"]


@pytest.mark.cpu_only(reason=HOST)
def test_the_shipped_trace_loads_with_the_shipped_draft() -> None:
    """The trace was recorded with the shipped draft; a trace of any other draft is refused."""
    assert trace_draft() == file_sha256(DEFAULT_WEIGHTS)
    trace = load_trace(DEFAULT_TRACE, draft_sha256=trace_draft())
    with pytest.raises(ValueError, match="recorded with the draft of sha256"):
        load_trace(DEFAULT_TRACE, draft_sha256="0" * 64)
    draft_manifest = json.loads(DEFAULT_WEIGHTS.with_suffix(".json").read_text())
    assert trace.num_requests >= 512 and trace.kinds == KINDS and trace.gamma == draft_manifest["training"]["gamma"]
    counts = torch.bincount(trace.kind_ids, minlength=len(KINDS))
    assert bool((counts >= trace.num_requests // 3 - 1).all())
    assert trace.meta["argmax_mismatches"]["count"] == 0 and trace.meta["workload"]["requests"] == trace.num_requests
    assert DEFAULT_TRACE.stat().st_size < 8e6


@pytest.mark.cpu_only(reason=HOST)
def test_the_shipped_traces_workload_is_its_seeded_spec() -> None:
    """Its prompts and kinds are `build_workload` of the manifest's spec; each N_i is the drawn length or
    ends at the target's first eos."""
    pytest.importorskip("transformers")
    from dspark.models.smollm2 import smollm2_gguf_path

    try:
        gguf = smollm2_gguf_path()
    except ImportError as e:
        pytest.skip(str(e))
    from transformers import AutoTokenizer

    trace = load_trace(DEFAULT_TRACE)
    reqs = build_workload(AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name),
                          WorkloadSpec(**trace.meta["workload"]))
    eos = trace.meta["eos_token_id"]
    for i, r in enumerate(reqs):
        n = int(trace.new_tokens[i])
        assert trace.kind(i) == r.kind and torch.equal(trace.prompt(i), r.prompt)
        assert n == r.max_new_tokens or (n < r.max_new_tokens and int(trace.greedy(i, n - 1, 1)) == eos)
