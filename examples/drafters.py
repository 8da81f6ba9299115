"""Speculative decoding for your own transformers pair: a target, a drafter, generate, losslessly.

Two drafters for the same target: prompt lookup (`NgramDrafter`: no model) and a small causal LM of the same
vocabulary (`CausalLMDrafter`). Each serves the same queue (prompts of different lengths, a stop id) and must
commit exactly the target's own greedy `generate` tokens; it prints tokens/s and how many drafts were accepted.

Run: `python examples/drafters.py` (tiny random Llamas, so it runs anywhere in seconds; for your models use
`AutoModelForCausalLM.from_pretrained(...)` for both, and `dspark.generate` for text in / text out).
"""
from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import dspark
from dspark.models import TransformersCausalLM
from dspark.serve.config import EngineConfig
from dspark.serve.policies import FixedK


def tiny_llama(layers: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False, initializer_range=0.2)
    return AutoModelForCausalLM.from_config(config).eval()


def main() -> None:
    torch.set_num_threads(1)  # tiny models: more intra-op threads only spin
    target_hf, draft_hf = tiny_llama(4, seed=0), tiny_llama(1, seed=1)   # your target and a smaller model
    reference = copy.deepcopy(target_hf)                                  # keeps transformers' own attention
    target = TransformersCausalLM(target_hf)                              # routes attention through dspark
    prompts = [[5, 17, 42, 9, 88, 5, 17, 42], [3, 61, 7, 3, 61], [12, 30, 99, 100, 101, 12]]
    stop = [11]

    with torch.no_grad():
        want = [reference.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=stop,
                                   pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    for drafter in (dspark.NgramDrafter(n_min=1, n_max=3), dspark.CausalLMDrafter(draft_hf)):
        decoder = dspark.SpecDecoder(target, drafter, config=EngineConfig(cache_tokens=4096))
        out = decoder.generate(prompts, 24, FixedK(4), stop_token_ids=stop)
        got = [out.tokens[i, : int(n)].tolist() for i, n in enumerate(out.num_tokens)]
        assert got == want, (type(drafter).__name__, got, want)
        spec = [s for s in out.steps if s.speculated]
        accepted = sum(int(s.correct_lens.sum()) for s in spec) / sum(4 * s.requests.numel() for s in spec)
        print(f"{type(drafter).__name__}: {int(out.num_tokens.sum())} tokens in {out.seconds:.2f} s "
              f"({int(out.num_tokens.sum()) / out.seconds:.0f} tok/s), {100 * accepted:.0f} % of the drafts accepted, "
              f"finish reasons {out.finish_reasons}; equal to transformers' generate")


if __name__ == "__main__":
    main()
