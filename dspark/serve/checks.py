"""The decode loop's argument checks, at its boundary: device, prompts, per-request new-token counts, options,
sequence lengths."""
from __future__ import annotations

from typing import Iterable, Sequence, Union

import torch
from torch import Tensor, nn

DEVICES = ("cpu", "cuda")
Prompts = Union[Tensor, Sequence[Sequence[int]]]  # [N, P] int64, or N token-id sequences of any lengths


def check_device(device: str | torch.device) -> torch.device:
    """`cpu` or `cuda` (the latter only when available)."""
    name = str(device)
    if name.split(":")[0] not in DEVICES:
        raise ValueError(f"unknown device {name!r}; choose one of: {', '.join(DEVICES)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
    return dev


def check_prompts(prompts: Prompts, vocab_size: int) -> list[Tensor]:
    """N >= 1 prompts as host int64 tensors [P_i], each of >= 1 token ids in [0, vocab_size): from an int64
    tensor [N, P] or a sequence of token-id sequences (lengths may differ)."""
    if isinstance(prompts, Tensor):
        if prompts.dim() != 2 or prompts.dtype != torch.long:
            raise ValueError(f"prompts as a tensor must be int64 [N, P], got {prompts.dtype} {list(prompts.shape)}")
        seqs = list(prompts.cpu())
    elif isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
        seqs = []
        for i, q in enumerate(prompts):
            try:
                t = torch.as_tensor(q)
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(f"prompts[{i}] must be a sequence of token ids, got {q!r}") from None
            if t.dim() == 1 and t.numel() == 0:
                raise ValueError(f"prompts[{i}] is empty; each prompt needs at least one token")
            if t.dim() != 1 or not t.dtype in (torch.int64, torch.int32):
                raise ValueError(f"prompts[{i}] must be a 1-D sequence of int token ids, got {t.dtype} {list(t.shape)}")
            seqs.append(t.cpu().to(torch.int64))
    else:
        raise ValueError(f"prompts must be an int64 tensor [N, P] or a list of token-id sequences, got "
                         f"{type(prompts).__name__}")
    if not seqs:
        raise ValueError("prompts is empty: give at least one prompt")
    for i, q in enumerate(seqs):
        bad = (q < 0) | (q >= vocab_size)
        if bool(bad.any()):
            j = int(bad.nonzero()[0])
            raise ValueError(f"prompts[{i}][{j}] = {int(q[j])} is outside the vocabulary [0, {vocab_size})")
    return seqs


def check_stop_ids(stop_token_ids: Sequence[int], vocab_size: int) -> Tensor | None:
    """Stop token ids as an int64 tensor (None when there are none), each in [0, vocab_size)."""
    if isinstance(stop_token_ids, (str, bytes, Tensor)) or not isinstance(stop_token_ids, Sequence):
        raise ValueError(f"stop_token_ids must be a sequence of ints, got {stop_token_ids!r}")
    for i, t in enumerate(stop_token_ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"stop_token_ids[{i}] = {t!r} is not an int in the vocabulary [0, {vocab_size})")
    return torch.tensor(list(stop_token_ids), dtype=torch.int64) if stop_token_ids else None


def check_new_tokens(max_new_tokens: int | Tensor, n: int) -> Tensor:
    """Per-request new-token counts as a host int64 tensor [n], each >= 1."""
    if isinstance(max_new_tokens, Tensor):
        if max_new_tokens.shape != (n,) or max_new_tokens.dtype != torch.int64:
            raise ValueError(f"max_new_tokens as a tensor must be int64 [{n}] (one count per prompt), got "
                             f"{max_new_tokens.dtype} {list(max_new_tokens.shape)}")
        counts = max_new_tokens.cpu()
        if bool((counts < 1).any()):
            bad = int((counts < 1).nonzero()[0])
            raise ValueError(f"max_new_tokens[{bad}] = {int(counts[bad])} must be >= 1")
        return counts
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int or an int64 tensor [N], got {max_new_tokens!r}")
    return torch.full((n,), max_new_tokens, dtype=torch.int64)


def check_positive_or_none(name: str, value: int | None) -> None:
    """An optional count: None or an int >= 1 (ValueError naming the option and the value otherwise)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def check_fits(prompt_len: int, new_tokens: int, width: int, max_seq_len: int, owner: str, fix: str) -> int:
    """The longest sequence a run reaches (prompt + new tokens + one verify width); ValueError naming
    `owner`'s `max_seq_len` and the `fix` when it does not fit."""
    max_len = prompt_len + new_tokens + width
    if max_len > max_seq_len:
        raise ValueError(f"prompt {prompt_len} + max_new_tokens {new_tokens} + verify width {width} = {max_len} "
                         f"exceeds {owner} max_seq_len {max_seq_len}: {fix}")
    return max_len


def check_seq_len(models: Iterable[nn.Module], prompt_len: int, new_tokens: int, width: int) -> int:
    """`check_fits` against every model's `geometry.max_seq_len`, naming the model it exceeds."""
    for m in models:
        check_fits(prompt_len, new_tokens, width, m.geometry.max_seq_len, f"the {type(m).__name__}'s",
                   "shorten the prompts or max_new_tokens")
    return prompt_len + new_tokens + width


def check_drafting(policy: object, b: int) -> Tensor:
    """A policy's `drafting` mask for a step of b requests: a host bool tensor [b]."""
    mask = policy.drafting
    if not (isinstance(mask, Tensor) and mask.dtype == torch.bool and tuple(mask.shape) == (b,) and mask.is_cpu):
        got = f"{mask.dtype} {list(mask.shape)} on {mask.device}" if isinstance(mask, Tensor) else repr(mask)
        raise ValueError(f"policy {policy.name!r} set drafting to {got}: it must be None or a CPU bool tensor [B={b}], "
                         "True for each request of the step that drafts")
    return mask
