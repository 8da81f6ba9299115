"""Serving basics: top-k / top-p sampling warped exactly as transformers warps, committed tokens distributed as
the target's warped distribution for every drafter (rejection sampling against warped p and q), the text entry
`dspark.generate` (text in, text out, stop at EOS) equal to transformers' `generate`, and bad input named."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dspark
from dspark.models.draft import DraftConfig, DraftModel
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve.config import EngineConfig, SamplingParams
from dspark.serve.drafters.causal_lm import CausalLMDrafter
from dspark.serve.drafters.ngram import NgramDrafter
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import FixedK
from dspark.serve.sampling import Sampling
from tests.drafter_models import EOS, llama, target_and_draft_lm, truncated, word_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def transformers_warp(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """transformers' own sampling warpers, in generate's order."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
                                  + ([TopPLogitsWarper(top_p)] if top_p else []))
    return warpers(None, logits.clone())


@given(shape=st.tuples(st.integers(1, 4), st.integers(2, 40)), temperature=st.floats(0.25, 4.0),
       top_k=st.none() | st.integers(1, 50), top_p=st.none() | st.floats(0.05, 1.0), seed=st.integers(0, 2**16))
def test_warp_is_transformers_warp(shape, temperature, top_k, top_p, seed, device) -> None:
    logits = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(device)
    ours = Sampling(SamplingParams(temperature, top_k, top_p), torch.Generator()).warp(logits)
    theirs = transformers_warp(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    torch.testing.assert_close(ours[torch.isfinite(ours)], theirs[torch.isfinite(theirs)])


VOCAB6, TEMP, SAMPLES = 6, 1.0, 2000
PROMPT = [1, 4, 2, 5, 0, 1, 4]  # "1 4" recurs: the n-gram drafter proposes "2 5 0"


@pytest.fixture(scope="module")
def small_target() -> TransformersCausalLM:
    return TransformersCausalLM(llama(2, vocab=VOCAB6, seed=3, std=0.15))


def _drafter(name: str, target: TransformersCausalLM):
    if name == "ngram":
        return NgramDrafter(1, 3)
    if name == "causal-lm":
        return CausalLMDrafter(truncated(target.hf_model))
    torch.manual_seed(4)  # an untrained block draft: both accepts and rejects happen
    head = target.hf_model.get_output_embeddings().weight
    cfg = DraftConfig(hidden_size=64, vocab_size=VOCAB6, draft_vocab_size=VOCAB6, num_q_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=32, chain_size=32, gamma=3, markov_rank=2, max_seq_len=64)
    return DraftModel(cfg, target.hf_model.get_input_embeddings().weight, head, torch.arange(VOCAB6)).eval()


def _two_token_dist(target: TransformersCausalLM, prompt: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """p(t1, t2 | prompt) [V * V] by enumeration: transformers' forward and warpers."""
    v = target.geometry.vocab_size
    with torch.no_grad(), target.own_attention() as model:
        p1 = torch.softmax(transformers_warp(model(prompt[None]).logits[:, -1], TEMP, top_k, top_p), -1)[0]
        ctx = torch.cat([prompt[None].expand(v, -1), torch.arange(v, device=prompt.device)[:, None]], 1)
        p2 = torch.softmax(transformers_warp(model(ctx).logits[:, -1], TEMP, top_k, top_p), -1)
    return (p1[:, None] * p2).flatten().double().cpu()


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    expected = probs * counts.sum()
    cells = expected > 5
    return float(((counts - expected) ** 2 / expected)[cells].sum()), int(cells.sum()) - 1


@pytest.mark.parametrize("warp", [{"top_k": 4}, {"top_p": 0.9}], ids=["top-k", "top-p"])
@pytest.mark.parametrize("name", ["block", "ngram", "causal-lm"])
def test_committed_tokens_follow_the_warped_target(small_target, name: str, warp: dict, device) -> None:
    """Chi-square of the committed (t1, t2) pairs against the exact warped target distribution."""
    dec = SpecDecoder(small_target, _drafter(name, small_target),
                      EngineConfig(cache_tokens=SAMPLES * 16, page_size=8, device=device))
    prompt = torch.tensor(PROMPT, device=device)
    top_k, top_p = warp.get("top_k"), warp.get("top_p")
    out = dec.generate(prompt[None].expand(SAMPLES, -1).contiguous(), 2, FixedK(3),
                       SamplingParams(temperature=TEMP, seed=7, **warp))
    commits = torch.cat([s.commit_lens.cpu() for s in out.steps])
    assert bool((commits > 1).any()) and bool((commits == 1).any()), "need both accepts and rejects"
    counts = torch.bincount((out.tokens[:, 0] * VOCAB6 + out.tokens[:, 1]).cpu(), minlength=VOCAB6**2).double()
    chi2, df = _chi2(counts, _two_token_dist(small_target, prompt, top_k, top_p))
    assert df >= 8, f"too few populated cells ({df + 1}) for a meaningful test"
    assert chi2 < df + 6 * (2 * df) ** 0.5, (chi2, df)
    # the test tells the warped distribution from the unwarped one
    chi2_raw, df_raw = _chi2(counts, _two_token_dist(small_target, prompt, None, None))
    assert chi2_raw > df_raw + 6 * (2 * df_raw) ** 0.5


def _hf_greedy(target: TransformersCausalLM, ids: list[int], n: int, eos: int) -> list[int]:
    with torch.no_grad(), target.own_attention() as model:
        config = copy.deepcopy(model.generation_config)
        config.update(do_sample=False, max_new_tokens=n, eos_token_id=eos, pad_token_id=0, temperature=None,
                      top_p=None, top_k=None)
        x = torch.tensor([ids], device=model.device)
        return model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)[0, len(ids):].tolist()


def test_text_in_text_out_equals_transformers_generate(device) -> None:
    target, draft_lm = target_and_draft_lm()
    target.to(device)  # dspark.generate runs where the target's weights are
    tok = word_tokenizer()
    texts = ["w53 w4 w25 w59 w35", "w30 w31 w7", "w29 w15 w22 w57 w38 w28", "w40 w3 w3 w3 w11 w40 w3"]
    want = [_hf_greedy(target, tok(t)["input_ids"], 20, EOS) for t in texts]
    assert {w[-1] == EOS for w in want} == {True, False}, "some stop at EOS, some run to the length"
    for drafter in (None, CausalLMDrafter(draft_lm, tokenizer=tok)):
        out = dspark.generate(texts, target=target, tokenizer=tok, drafter=drafter, k=3, max_new_tokens=20)
        assert out.tokens == want
        assert out.texts == [tok.decode(w, skip_special_tokens=True) for w in want]
        assert out.finish_reasons == ["stop" if w[-1] == EOS else "length" for w in want]
        assert out.tokens_per_second > 0 and any(s.speculated for s in out.result.steps)
    one = dspark.generate(texts[1], target=target, tokenizer=tok, max_new_tokens=5)
    assert one.tokens == [want[1][:5]]


@pytest.mark.cpu_only(reason="the example as written, on the CPU")
def test_the_drafters_example_runs(capsys) -> None:
    import runpy
    from pathlib import Path

    runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "drafters.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("equal to transformers' generate") == 2


def test_bad_input_is_named(device) -> None:
    target, _ = target_and_draft_lm()
    dec = SpecDecoder(target, NgramDrafter(), config=EngineConfig(cache_tokens=512, page_size=8, device=device))
    prompts = [[5, 9, 12, 5], [3, 4, 5]]
    for value in (0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\], got"):
            dec.generate(prompts, 4, FixedK(2), sampling=SamplingParams(temperature=1.0, top_p=value))
    with pytest.raises(ValueError, match="top_k must be an int >= 1, got 0"):
        dec.generate(prompts, 4, FixedK(2), sampling=SamplingParams(temperature=1.0, top_k=0))
    with pytest.raises(ValueError, match=r"temperature must be a number in \[0, inf\), got -1"):
        SamplingParams(temperature=-1)
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        dec.generate(prompts, 4, FixedK(2), sampling=True)
    with pytest.raises(ValueError, match="prompts\\[1\\] is empty; each prompt needs at least one token"):
        dec.generate([[5, 9, 12], []], 4, FixedK(2))
    with pytest.raises(ValueError, match=r"stop_token_ids\[1\] = 64 is not an int in the vocabulary \[0, 64\)"):
        dec.generate(prompts, 4, FixedK(2), stop_token_ids=[2, 64])
    tok = word_tokenizer()
    with pytest.raises(ValueError, match="prompts\\[1\\] must be a non-empty str, got ''"):
        dspark.generate(["w5 w6 w7", ""], target=target, tokenizer=tok)
    with pytest.raises(ValueError, match="prompts must be a non-empty text or a non-empty sequence of texts"):
        dspark.generate([], target=target, tokenizer=tok)
    with pytest.raises(ValueError, match="k must be an int >= 0, got -1"):
        dspark.generate("w5 w6 w7", target=target, tokenizer=tok, k=-1)


@pytest.mark.parametrize("draft_dtype", [torch.float32, torch.bfloat16])
def test_a_bf16_target_decodes_in_bf16_and_speculation_commits_its_own_greedy_tokens(draft_dtype, device) -> None:
    """The engine keeps a bf16 target in bf16 (its KV cache, the hidden states a drafter reads) with a float32
    or bf16 block draft; speculative decoding commits what the same engine's plain decoding commits."""
    from tests.engine_models import VOCAB, tiny_models

    target, draft = tiny_models(gamma=3)
    target = TransformersCausalLM(copy.deepcopy(target.hf_model).to(torch.bfloat16))
    dec = SpecDecoder(target, copy.deepcopy(draft).to(draft_dtype), config=EngineConfig(cache_tokens=1024, device=device))
    prompts = torch.randint(3, VOCAB, (4, 6), generator=torch.Generator().manual_seed(3)).to(device)
    plain = dec.generate(prompts, 10, FixedK(0))
    spec = dec.generate(prompts, 10, FixedK(3))
    assert dec.tcache.k.dtype == torch.bfloat16 and dec._target.hidden.dtype == torch.bfloat16
    assert dec._drafter.cache.k.dtype == draft_dtype
    assert torch.equal(spec.tokens, plain.tokens)
    assert any(bool((s.correct_lens > 0).any()) for s in spec.steps if s.speculated)  # drafts were accepted
