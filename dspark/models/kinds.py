"""Prompts of three kinds, from the stdlib splits of `dspark.models.corpus`: what the draft is trained and measured on.

- `code`: a window of a file's tokens at a random start (`corpus.prompt_windows`; the demo's prompts).
- `chat`: a question about a line-aligned window of a file's code, in SmolLM2-Instruct's chat template with its
  default system prompt; the model answers in English prose.
- `edit`: a copy-heavy edit request (re-indent, requote, strip comments) of a line-aligned window, the answer
  opened with a code fence: the target repeats much of the window (for the re-indent request on six
  train-split prompts, 9-100 % of its greedy trigrams were the window's, 50 % on average), so acceptance there
  rewards copying.

`prose_windows` is English text for teacher-forced training: windows of the stdlib's own language reference
(`pydoc_data.topics`), its topics split like the files (sorted by name, topic i is held out when i % 20 == 0,
calibration when i % 20 == 10, train otherwise).

A prompt of a kind has a fixed token count (`length`): the template's tokens plus as many window tokens as fit,
so prompts of one kind batch without padding. The question or instruction is drawn per prompt from a short
list (seeded); the split decides which files the windows come from, so held-out prompts of every kind come
from held-out files only.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.models.corpus import SPLITS, Encode, prompt_windows, stdlib_files
from dspark.util.validate import check_int

KINDS = ("code", "chat", "edit")
PROMPT_LEN = {"code": 32, "chat": 96, "edit": 112}  # the lengths the trainer and the per-kind measures use
MIN_WINDOW = 8  # window tokens a chat / edit prompt must keep beside its template

_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
_QUESTIONS = ("What does this Python code do?", "Explain this code.", "What is the purpose of this code?")
_EDITS = ("Rewrite this code with 2-space indentation:", "Rewrite this code with double quotes instead of single "
          "quotes:", "Rewrite this code with the comments removed:")
_OPEN = {"chat": "\n```python\n", "edit": "\n```python\n"}
_CLOSE = {"chat": "\n```<|im_end|>\n<|im_start|>assistant\n",
          "edit": "\n```<|im_end|>\n<|im_start|>assistant\n```python\n"}


def _line_windows(split: str, encode: Encode, count: int, length: int, seed: int, max_chars: int) -> list[list[int]]:
    """`count` windows of `length` tokens starting at a line start (lines encoded one by one), spread evenly
    over the split's files that hold one."""
    gen = torch.Generator().manual_seed(seed)
    files = stdlib_files(split)
    docs = []
    for i in torch.randperm(len(files), generator=gen).tolist():
        lines = [encode(line) for line in
                 files[i].read_text(encoding="utf-8", errors="replace")[:max_chars].splitlines(keepends=True)]
        left = torch.tensor([len(ids) for ids in lines][::-1]).cumsum(0).flip(0)  # tokens from each line on
        starts = torch.nonzero(left >= length).flatten()
        if starts.numel():
            docs.append((lines, starts))
    if not docs:
        raise ValueError(f"no {split} file holds a line-aligned window of length={length} tokens")
    per_doc = -(-count // len(docs))
    out: list[list[int]] = []
    for lines, starts in docs:
        for s in starts[torch.randint(0, starts.numel(), (per_doc,), generator=gen)].tolist():
            ids: list[int] = []
            for line in lines[s:]:
                ids += line
                if len(ids) >= length:
                    break
            out.append(ids[:length])
    return out[:count]


def kind_prompts(kind: str, split: str, encode: Encode, count: int, seed: int, length: int | None = None,
                 max_chars: int = 60_000) -> Tensor:
    """[count, length] int64 prompts of `kind` (`KINDS`) from the files of `split` (`corpus.SPLITS`).

    Args:
        kind: "code", "chat" or "edit".
        split: the corpus split the windows come from.
        encode: text -> token ids (the target's tokenizer, no special tokens added).
        count: prompts wanted.
        seed: the draw of files, starts and questions.
        length: tokens per prompt (default `PROMPT_LEN[kind]`); chat / edit keep >= MIN_WINDOW window tokens.
        max_chars: characters read from each file's start.
    Returns:
        int64 tensor [count, length].
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    length = PROMPT_LEN[kind] if length is None else length
    check_int("count", count, 1)
    check_int("length", length, 1)
    if kind == "code":
        return prompt_windows(split, encode, count, length, seed, max_chars)
    asks = _QUESTIONS if kind == "chat" else _EDITS
    gen = torch.Generator().manual_seed(seed + 7919)
    which = torch.randint(0, len(asks), (count,), generator=gen).tolist()
    heads = [encode(_SYSTEM + "<|im_start|>user\n" + a + _OPEN[kind]) for a in asks]
    tail = encode(_CLOSE[kind])
    longest = max(len(h) for h in heads) + len(tail)
    if length - longest < MIN_WINDOW:
        raise ValueError(f"length={length} leaves fewer than {MIN_WINDOW} window tokens beside the {kind} "
                         f"template ({longest} tokens)")
    windows = _line_windows(split, encode, count, length - min(len(h) for h in heads) - len(tail), seed, max_chars)
    rows = [heads[a] + w[: length - len(heads[a]) - len(tail)] + tail for a, w in zip(which, windows)]
    return torch.tensor(rows, dtype=torch.int64)


def prose_windows(split: str, encode: Encode, count: int, length: int, seed: int) -> Tensor:
    """[count, length] int64 windows of the language reference's topics of `split` at seeded random starts,
    spread evenly over the topics long enough to hold one."""
    from pydoc_data.topics import topics

    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    check_int("count", count, 1)
    check_int("length", length, 1)
    keep = {"train": lambda i: i % 10 != 0, "calibration": lambda i: i % 20 == 10, "heldout": lambda i: i % 20 == 0}
    docs = [ids for i, name in enumerate(sorted(topics)) if keep[split](i)
            for ids in [encode(topics[name])] if len(ids) > length]
    if not docs:
        raise ValueError(f"no {split} topic has more than length={length} tokens")
    gen = torch.Generator().manual_seed(seed)
    per_doc = -(-count // len(docs))
    rows = []
    for ids in docs:
        rows += [ids[s: s + length] for s in torch.randint(0, len(ids) - length, (per_doc,), generator=gen).tolist()]
    order = torch.randperm(len(rows), generator=gen)[:count]
    return torch.tensor([rows[i] for i in order.tolist()], dtype=torch.int64)
