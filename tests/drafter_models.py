"""Tiny models for the drafter tests: a random Llama target whose greedy text does not loop at once (an untied
LM head: with tied embeddings a random Llama repeats its last token), and smaller Llamas that share its
vocabulary (its first layers, with its embeddings, final norm and head: partly agreeing drafts), plus a
word-level tokenizer over the same vocabulary for the text entry."""
from __future__ import annotations

import functools

import torch

from dspark.models.transformers_lm import TransformersCausalLM

VOCAB = 64
EOS = 2


def llama(layers: int = 2, vocab: int = VOCAB, seed: int = 0, max_seq_len: int = 64, std: float = 0.2):
    """A random Llama (hidden 64, GQA 4 / 2 heads) with an untied head, weights drawn with `std`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=max_seq_len, rope_theta=1.0e5,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS, initializer_range=std,
                      attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def truncated(hf, layers: int = 1):
    """A smaller Llama: the first `layers` layers of `hf` with its embeddings, final norm and LM head."""
    small = llama(layers, hf.config.vocab_size, max_seq_len=hf.config.max_position_embeddings)
    keep = tuple(f"model.layers.{i}." for i in range(layers))
    small.load_state_dict({k: v for k, v in hf.state_dict().items() if not k.startswith("model.layers.")
                           or k.startswith(keep)})
    return small


@functools.lru_cache(maxsize=None)
def target_and_draft_lm() -> tuple[TransformersCausalLM, TransformersCausalLM]:
    """(2-layer target, 1-layer draft) over dspark's attention; transformers' own via `own_attention()`."""
    hf = llama(2)
    return TransformersCausalLM(hf), TransformersCausalLM(truncated(hf))


def word_tokenizer(vocab: int = VOCAB):
    """A transformers fast tokenizer whose words `w0` .. `w{vocab-1}` are the ids 0 .. vocab - 1 (EOS `w2`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token=f"w{EOS}", bos_token="w1")
