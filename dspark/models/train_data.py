"""The draft's data: labelled streams of text and of every prompt kind per corpus split (`train_draft`'s stage 1).

Text windows (`text_streams`: stdlib code and the language reference's prose) are teacher-forced: one target
pass over the window labels every position, with none of generating's step-by-step overhead. Per kind
(`dspark.models.kinds.KINDS`) a split gets `counts[kind]` prompts, drawn prefix-stably (a seeded permutation
of a fixed pool of `POOL` prompts: a run with fewer streams reads the first batches of a larger run's cache)
and continued greedily by the target (`stream_store.labelled_streams`, cached by content).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from dspark.models.corpus import SPLITS, Encode
from dspark.models.kinds import KINDS, PROMPT_LEN, kind_prompts, prose_windows
from dspark.models.stream_store import Streams, labelled_streams
from dspark.util.validate import check_int, check_path

Log = Callable[[str], None]
POOL = 4096  # prompts drawn per kind and split before the permutation; counts above it draw that many


@dataclass(frozen=True)
class StreamSpec:
    """Which labelled streams a call draws and how the target generates them, checked when built: prompts of the
    corpus `split` (`corpus.SPLITS`) drawn with `seed`, `batch` prompts per target generation batch (and per cache
    file), cached batches under the `cache` folder (None: nothing cached)."""

    split: str
    seed: int
    batch: int = 64
    cache: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        check_int("seed", self.seed, 0)
        check_int("batch", self.batch, 1)
        if self.cache is not None:
            object.__setattr__(self, "cache", check_path("cache", self.cache))


def draw_prompts(kind: str, split: str, encode: Encode, count: int, length: int, seed: int) -> Tensor:
    """[count, length] prompts of `kind` from `split`: the first `count` of a seeded permutation of a pool of
    max(count, POOL) prompts, so a smaller count is a prefix of a larger one."""
    pool = kind_prompts(kind, split, encode, max(count, POOL), seed, length)
    order = torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(seed + 104729))
    return pool[order[:count]]


def kind_streams(model: nn.Module, encode: Encode, spec: StreamSpec, counts: Sequence[int], *, new_tokens: int,
                 code_len: int, log: Log) -> dict[str, Streams]:
    """Labelled streams per kind with a count > 0: {kind: Streams}.

    Args:
        model: the target (transformers, its own attention).
        encode: text -> token ids.
        spec: the split and seed of the prompt draw, the generation batch and the cache folder.
        counts: streams per kind, in `KINDS` order (0 leaves a kind out).
        new_tokens: greedy tokens after each prompt.
        code_len: prompt length of the code kind (chat / edit use `PROMPT_LEN`).
        log: progress lines.
    Returns:
        {kind: Streams with tokens [count, P_kind + new_tokens]}.
    """
    if len(counts) != len(KINDS):
        raise ValueError(f"counts must give one count per kind {KINDS}, got {list(counts)}")
    split, out = spec.split, {}
    for kind, count in zip(KINDS, counts):
        if count:
            length = code_len if kind == "code" else PROMPT_LEN[kind]
            prompts = draw_prompts(kind, split, encode, count, length, spec.seed)
            out[kind] = labelled_streams(model, prompts, new_tokens, batch=spec.batch, cache=spec.cache,
                                         log=lambda msg, k=kind: log(f"{split} {k} {msg}"))
    return out


def text_streams(model: nn.Module, encode: Encode, spec: StreamSpec, code: int, prose: int, *, length: int,
                 log: Log) -> dict[str, Streams]:
    """Teacher-forced windows: {"code_text": [code, length + 1], "prose_text": [prose, length + 1]} (a count
    of 0 leaves the source out; the one generated token per window is not a label of any row but the last).

    Args:
        model, encode, spec, log: as `kind_streams`.
        code: stdlib code windows of `spec.split`.
        prose: language-reference windows of `spec.split`.
        length: tokens per window.
    Returns:
        {source: Streams}.
    """
    split, out = spec.split, {}
    if code:
        prompts = draw_prompts("code", split, encode, code, length, spec.seed)
        out["code_text"] = labelled_streams(model, prompts, 1, batch=spec.batch, cache=spec.cache,
                                            log=lambda msg: log(f"{split} code text {msg}"))
    if prose:
        prompts = prose_windows(split, encode, max(prose, POOL), length, spec.seed)[:prose]
        out["prose_text"] = labelled_streams(model, prompts, 1, batch=spec.batch, cache=spec.cache,
                                             log=lambda msg: log(f"{split} prose text {msg}"))
    return out
