"""Tiny models for the engine tests: a random 2-layer Llama target (transformers' own model code) and a
DraftModel distilled on it for a few seconds, so drafts are partly accepted (both outcomes are exercised)."""
from __future__ import annotations

import functools

import torch

from dspark.models.confidence_fit import fit_confidence, stream_rows
from dspark.models.distil import DistilConfig, distil
from dspark.models.draft import DraftConfig, DraftModel
from dspark.models.stream_store import labelled_streams
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve.policies import FixedK

VOCAB = 64


def tiny_llama(vocab: int = VOCAB, seed: int = 0, max_seq_len: int = 128, embed_std: float = 1.0):
    """A randomly initialised 2-layer Llama (GQA 4 / 2 heads) in transformers' own sdpa attention; its
    (tied) embedding drawn with `embed_std` (1: a peaked next-token distribution)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=max_seq_len,
                      rope_theta=1.0e5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                      attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, embed_std)
    return model


@functools.lru_cache(maxsize=None)
def tiny_models(vocab: int = VOCAB, seed: int = 0, gamma: int = 4, steps: int = 60, max_seq_len: int = 64
                ) -> tuple[TransformersCausalLM, DraftModel]:
    """(target, draft): the draft distilled `steps` steps on the target's greedy streams of random prompts
    (`dspark.models.distil`, as the real trainer), its confidence head fitted briefly on other streams."""
    hf = tiny_llama(vocab, seed, max_seq_len)
    gen = torch.Generator().manual_seed(seed + 1)
    streams = labelled_streams(hf, torch.randint(0, vocab, (48, 8), generator=gen), 24, batch=16)
    emb, head = hf.get_input_embeddings().weight.detach(), hf.get_output_embeddings().weight.detach()
    dcfg = DraftConfig(hidden_size=64, vocab_size=vocab, draft_vocab_size=vocab, num_q_heads=4, num_kv_heads=2,
                       head_dim=16, intermediate_size=64, chain_size=64, gamma=gamma, markov_rank=4,
                       max_seq_len=max_seq_len)
    torch.manual_seed(seed + 2)
    draft = DraftModel(dcfg, emb, head, torch.arange(vocab))
    distil(draft, {"code": streams.select(slice(0, 32))}, DistilConfig(steps=steps, rows=256, lr=2e-3,
                                                                         weight_decay=0.1, soft_weight=0.5,
                                                                         feature_weight=0.5, seed=seed),
           log=lambda _: None)
    rest = streams.select(slice(32, None))
    fit_confidence(draft, stream_rows(draft, rest.tokens, rest.hidden, 8), 3)  # moderate logits
    return TransformersCausalLM(hf), draft.eval()



class PartialFixedK(FixedK):
    """fixed-k whose steps draft for some requests only (`Policy.drafting`): every `every`-th request of the
    step, shifting by one each step; the rest verify their root only."""

    def __init__(self, k: int, every: int = 2) -> None:
        super().__init__(k)
        self.every, self._turn = every, 0

    def speculate(self, slots: torch.Tensor, generations: torch.Tensor) -> bool:
        self._turn += 1
        self.drafting = (torch.arange(slots.numel()) + self._turn) % self.every == 0
        return True
