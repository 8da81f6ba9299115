"""dspark in your own transformers model: prefill two prompts, then one compact verify step, all over a
paged KV cache, and check the committed tokens against transformers' own greedy `generate`.

Run: `python examples/own_model.py` (a tiny random Llama; swap in any Llama-family causal LM).
"""
from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import dspark
from dspark.models import (  # importing registers dspark's attention function
    PagedAttend,
    TransformersCausalLM,
)


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, initializer_range=0.2, eos_token_id=None)
    model = AutoModelForCausalLM.from_config(config)     # your model, code and weights untouched
    reference = copy.deepcopy(model)                     # keeps transformers' default attention
    lm = TransformersCausalLM(model)                     # model.set_attn_implementation("dspark_paged")
    g = lm.geometry

    # a paged KV cache with the model's KV heads (GQA), and one attention plan sized for the largest forward
    page_size, pages_per_request, batch = 4, 4, 2
    k_cache = torch.zeros(g.num_layers, batch * pages_per_request, page_size, g.num_kv_heads, g.head_dim)
    v_cache = torch.zeros_like(k_cache)
    block_table = torch.arange(batch * pages_per_request, dtype=torch.int32).reshape(batch, pages_per_request)
    attn = dspark.RaggedVerifyAttention(dspark.AttentionShape(16, batch + 1, pages_per_request, g.num_q_heads,
                                                              g.num_kv_heads, g.head_dim, page_size,
                                                              sm_scale=g.sm_scale), "cpu", torch.float32)

    def forward(tokens: torch.Tensor, layout: dspark.RaggedVerifyLayout, prefix_lens: torch.Tensor) -> torch.Tensor:
        attend = PagedAttend(attn, k_cache, v_cache, layout, prefix_lens, block_table)
        return lm.logits(lm(tokens, attend.positions, attend))   # positions come from the layout

    # prefill: both prompts packed into one forward
    prompts = [torch.tensor([5, 17, 42, 9, 88]), torch.tensor([3, 61, 7])]
    lens = torch.tensor([len(p) for p in prompts])
    prefill = dspark.RaggedVerifyLayout.from_verify_lens(lens)
    logits = forward(torch.cat(prompts), prefill, torch.zeros(batch, dtype=torch.int64))
    roots = logits[lens.cumsum(0) - 1].argmax(-1)            # each request's first generated token

    # verify: request 0 proposes the target's own greedy tokens, request 1 random ones; compact rows
    # (root + the drafts worth verifying) padded to a captured tier, padding rows never write the cache
    gamma = 3
    greedy = [reference.generate(p[None], max_new_tokens=gamma + 2, do_sample=False)[0, len(p):] for p in prompts]
    drafts = torch.stack([greedy[0][1: gamma + 1], torch.randint(0, 128, (gamma,))])
    verify_lens = torch.tensor([4, 2], dtype=torch.int32)
    inputs = dspark.build_verify_inputs(dspark.VerifyExecution("compact", tiers=(8,), graph_slots=batch + 1),
                                        verify_lens, roots, drafts, lens, kv=dspark.PagedKV(block_table, page_size))
    logits = forward(inputs.input_ids, inputs.layout, lens)
    result = dspark.accept_greedy(drafts, logits, verify_lens=inputs.caps, layout=inputs.layout)

    for r in range(batch):
        committed = [int(roots[r])] + result.tokens[r, : int(result.commit_lens[r])].tolist()
        assert committed == greedy[r][: len(committed)].tolist(), (r, committed, greedy[r])
        print(f"request {r}: committed {committed} (transformers' generate agrees)")


if __name__ == "__main__":
    main()
