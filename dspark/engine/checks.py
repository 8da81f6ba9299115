"""The decode loop's argument checks, at its boundary: device, prompts, per-request new-token counts, options,
sequence lengths."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

DEVICES = ("cpu", "cuda")


def check_device(device: str | torch.device) -> torch.device:
    """`cpu` or `cuda` (the latter only when available)."""
    name = str(device)
    if name.split(":")[0] not in DEVICES:
        raise ValueError(f"unknown device {name!r}; choose one of: {', '.join(DEVICES)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
    return dev


def check_prompts(prompts: Tensor) -> tuple[int, int]:
    """(N, P) of int64 prompts [N, P], N >= 1 and P >= 3."""
    if not isinstance(prompts, Tensor) or prompts.dim() != 2 or prompts.dtype != torch.long:
        raise ValueError(f"prompts must be an int64 tensor [B, P], got {getattr(prompts, 'shape', prompts)}")
    b, p = prompts.shape
    if b < 1 or p < 3:
        raise ValueError(f"need at least one prompt of >= 3 tokens, got shape {tuple(prompts.shape)}")
    return b, p


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
