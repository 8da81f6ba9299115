"""`dspark.generate`: text in, text out, through a tokenizer; the shortest way to speculative decoding with your
own transformers model. One call builds a `SpecDecoder` for the prompts, serves them all at once with fixed-k
drafting and decodes the continuations; `SpecDecoder` itself serves token ids, queues on fewer slots, adaptive
policies and step telemetry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from dspark.models.draft import DraftModel
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve.config import GREEDY, EngineConfig, SamplingParams
from dspark.serve.drafters.base import Drafter
from dspark.serve.drafters.ngram import NgramDrafter
from dspark.serve.engine import SpecDecoder
from dspark.serve.outcome import GenerateResult
from dspark.serve.policies.fixed import FixedK
from dspark.util.validate import check_int
from dspark.verify.layout import tier_ladder


@dataclass
class Generation:
    """What `generate` produced for N prompts."""

    texts: list[str]            # each prompt's continuation, decoded (special tokens skipped)
    tokens: list[list[int]]     # each prompt's new token ids (a stop token included)
    finish_reasons: list[str]   # per prompt: "length" (max_new_tokens reached) or "stop"
    result: GenerateResult      # the engine's record: steps, commit lengths, phase times

    @property
    def tokens_per_second(self) -> float:
        """New tokens over the run's charged seconds (prefill included)."""
        return sum(map(len, self.tokens)) / self.result.seconds


def generate(prompts: str | Sequence[str], *, target: Any, tokenizer: Any, drafter: Drafter | DraftModel | None = None,
             k: int = 4, max_new_tokens: int = 64, sampling: SamplingParams = GREEDY) -> Generation:
    """Continue each prompt with speculative decoding, losslessly: greedy output equals the target's own greedy
    decoding, sampled output follows the target's (warped) distribution.

    prompts: one text or N texts (each non-empty: at least one token once tokenized). target: a transformers
    causal LM of the Llama family (wrapped in `TransformersCausalLM`, which routes its attention through dspark)
    or an already wrapped one, run where its weights are; tokenizer: its tokenizer (encodes the prompts, decodes
    the outputs, is compared with a drafter's own, and its EOS ends a request). drafter: an `NgramDrafter` (the
    default: prompt lookup, no model), a `CausalLMDrafter`, a `DraftModel` or any `Drafter`. k: drafts per step
    (fixed-k; 0: plain decoding). max_new_tokens: per prompt. sampling: greedy (the default) or sampled draws.
    Verify steps are padded to token tiers (`tier_ladder`), captured as CUDA graphs on a GPU.
    A `SpecDecoder` serves token ids, other policies and modes, queues on fewer slots and step telemetry.
    Returns the Generation (texts, token ids, finish reasons, the engine's result).
    """
    texts = [prompts] if isinstance(prompts, str) else prompts
    if isinstance(texts, (bytes, torch.Tensor)) or not isinstance(texts, Sequence) or not texts:
        raise ValueError(f"prompts must be a non-empty text or a non-empty sequence of texts, got {prompts!r}")
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text:
            raise ValueError(f"prompts[{i}] must be a non-empty str, got {text!r}")
    check_int("max_new_tokens", max_new_tokens, 1)
    policy = FixedK(check_int("k", k, 0))
    lm = target if isinstance(target, TransformersCausalLM) else TransformersCausalLM(target)
    ids = [list(x) for x in tokenizer(list(texts))["input_ids"]]
    eos = getattr(tokenizer, "eos_token_id", None)
    per_request = max(map(len, ids)) + max_new_tokens + policy.num_drafts + 1
    config = EngineConfig(cache_tokens=len(ids) * (per_request + 16), page_size=16,
                          device=next(lm.parameters()).device, tiers=tier_ladder([len(ids)], k + 1))
    decoder = SpecDecoder(lm, NgramDrafter() if drafter is None else drafter, config, tokenizer)
    result = decoder.generate(ids, max_new_tokens, policy, sampling, stop_token_ids=[] if eos is None else [eos])
    new = [result.tokens[i, : int(n)].tolist() for i, n in enumerate(result.num_tokens)]
    return Generation([tokenizer.decode(t, skip_special_tokens=True) for t in new], new, result.finish_reasons,
                      result)
