"""The default policy-lab workload: three request kinds built from held-out text, mixed in one seeded queue.

DSpark's premise is heterogeneity: how many drafts are worth verifying differs between requests, so the
workload mixes kinds whose acceptance differs (about a third each, in a shuffled arrival order):
  - `code`: continue a window of held-out standard-library code (plain completion, no template);
  - `chat`: a question about a held-out snippet, asked in the Instruct model's own chat template;
  - `copy`: an edit whose answer repeats most of the snippet (rename a variable the snippet uses, add type
    hints, ...), in the same template.
All text comes from the `heldout` split of `dspark.models.corpus` (the draft and its head never trained on
it); windows start at a line start. A chat or copy prompt is the template's token ids before the snippet,
the snippet's own token ids, then the template's ids after it. Prompt (code) and snippet lengths are drawn
uniformly, output lengths as min_new_tokens + an exponential, capped at max_new_tokens. One
`random.Random(seed)` draws everything, so a seed gives the same requests on every machine with the same
Python (the corpus is its standard library).
"""
from __future__ import annotations

import bisect
import builtins
import keyword
import random
import re
from dataclasses import asdict, dataclass
from typing import Protocol, Sequence

import torch
from torch import Tensor

from dspark.models.corpus import stdlib_files
from dspark.util.validate import check_int, check_type

KINDS = ("code", "chat", "copy")
MAX_CHARS = 60_000  # each held-out file's first characters, as `dspark.models.corpus.prompt_windows` reads
SNIPPET = "\x00"  # where the snippet's tokens go in the rendered template (never in an instruction)
CHAT_QUESTIONS = (
    "What does this code do?",
    "Explain this Python code step by step.",
    "What does this function do? Answer in two sentences.",
    "Is there a bug in this code? Explain briefly.",
    "Which Python features does this code use?",
)
COPY_EDITS = (
    "Add type hints to this code. Reply with the whole code.",
    "Rewrite this code with a short comment above every statement. Reply with the whole code.",
    "Repeat this code exactly, with its comments removed.",
)
RENAME = "Rewrite this code with the variable `{old}` renamed to `{new}`. Reply with the whole code."
_IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{2,}\b")
_RESERVED = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls"}


class Tokenizer(Protocol):
    """What the workload needs of a transformers tokenizer."""

    def __call__(self, text: str, add_special_tokens: bool = ...) -> dict: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict], tokenize: bool = ..., add_generation_prompt: bool = ...
                            ) -> str: ...


@dataclass(frozen=True)
class WorkloadSpec:
    """How many requests of what shape; lengths are token counts, each range inclusive."""

    requests: int = 512
    seed: int = 0
    min_prompt_len: int = 24  # code prompts
    max_prompt_len: int = 96
    min_snippet_len: int = 16  # the code a chat / copy prompt shows (the template comes on top)
    max_snippet_len: int = 80
    min_new_tokens: int = 16
    mean_new_tokens: int = 64
    max_new_tokens: int = 160

    def __post_init__(self) -> None:
        check_int("requests", self.requests, 1)
        check_int("seed", self.seed, 0)
        check_int("min_prompt_len", self.min_prompt_len, 3)
        check_int("max_prompt_len", self.max_prompt_len, self.min_prompt_len)
        check_int("min_snippet_len", self.min_snippet_len, 1)
        check_int("max_snippet_len", self.max_snippet_len, self.min_snippet_len)
        check_int("min_new_tokens", self.min_new_tokens, 1)
        check_int("mean_new_tokens", self.mean_new_tokens, self.min_new_tokens)
        check_int("max_new_tokens", self.max_new_tokens, self.mean_new_tokens)

    def to_dict(self) -> dict:
        """JSON-ready fields (the trace manifest's `workload`)."""
        return asdict(self)


@dataclass(frozen=True)
class Request:
    """One request of a workload: its kind, prompt token ids [P] int64 and output length."""

    kind: str
    prompt: Tensor
    max_new_tokens: int


class _Corpus:
    """The held-out files' token ids, and for each the positions where a line starts."""

    def __init__(self, tokenizer: Tokenizer):
        docs = [tokenizer(f.read_text(encoding="utf-8", errors="replace")[:MAX_CHARS], add_special_tokens=False)
                ["input_ids"] for f in stdlib_files("heldout")]
        vocab = sorted({i for ids in docs for i in ids})
        newline = {i for i in vocab if "\n" in tokenizer.decode([i])}
        self.docs = docs
        self.line_starts = [[0] + [p + 1 for p, i in enumerate(ids[:-1]) if i in newline] for ids in docs]

    def window(self, n: int, rng: random.Random) -> list[int]:
        """n token ids of one file, starting at a line start (a seeded file, then a seeded start)."""
        docs = [d for d, ids in enumerate(self.docs) if len(ids) >= n]
        if not docs:
            raise ValueError(f"no held-out file has {n} tokens; choose shorter prompt lengths")
        d = docs[rng.randrange(len(docs))]
        starts = self.line_starts[d][: bisect.bisect_right(self.line_starts[d], len(self.docs[d]) - n)]
        return self.docs[d][starts[rng.randrange(len(starts))]:][:n]


def _templated(tokenizer: Tokenizer, instruction: str, snippet: list[int]) -> list[int]:
    """The chat template's ids for a user turn `instruction` + a code block, with the snippet's ids inside it."""
    content = f"{instruction}\n```python\n{SNIPPET}\n```"
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    head, tail = text.split(SNIPPET)
    return (tokenizer(head, add_special_tokens=False)["input_ids"] + snippet
            + tokenizer(tail, add_special_tokens=False)["input_ids"])


def _names(text: str) -> list[str]:
    """Identifiers a rename could target: not keywords or builtins; those used twice or more if any."""
    counts: dict[str, int] = {}
    for name in _IDENTIFIER.findall(text):
        if name not in _RESERVED:
            counts[name] = counts.get(name, 0) + 1
    repeated = sorted(n for n, c in counts.items() if c >= 2)
    return repeated or sorted(counts)


def _copy_instruction(tokenizer: Tokenizer, snippet: list[int], rng: random.Random) -> str:
    """Half the time a rename of an identifier the snippet uses (when it has one), else a generic edit."""
    names = _names(tokenizer.decode(snippet)) if rng.random() < 0.5 else []
    if names:
        old = names[rng.randrange(len(names))]
        return RENAME.format(old=old, new=f"new_{old}")
    return COPY_EDITS[rng.randrange(len(COPY_EDITS))]


def build_workload(tokenizer: Tokenizer, spec: WorkloadSpec = WorkloadSpec()) -> list[Request]:
    """The spec's requests in arrival order (kinds about a third each, shuffled), seeded by `spec.seed` alone.

    tokenizer: the target's (a transformers tokenizer with a chat template)."""
    check_type("spec", spec, WorkloadSpec)
    corpus, rng = _Corpus(tokenizer), random.Random(spec.seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(spec.requests)]
    rng.shuffle(kinds)
    extra = spec.mean_new_tokens - spec.min_new_tokens
    out = []
    for kind in kinds:
        drawn = round(rng.expovariate(1.0 / extra)) if extra else 0
        new_tokens = min(spec.max_new_tokens, spec.min_new_tokens + drawn)
        if kind == "code":
            prompt = corpus.window(rng.randint(spec.min_prompt_len, spec.max_prompt_len), rng)
        else:
            snippet = corpus.window(rng.randint(spec.min_snippet_len, spec.max_snippet_len), rng)
            instruction = (CHAT_QUESTIONS[rng.randrange(len(CHAT_QUESTIONS))] if kind == "chat"
                           else _copy_instruction(tokenizer, snippet, rng))
            prompt = _templated(tokenizer, instruction, snippet)
        out.append(Request(kind, torch.tensor(prompt, dtype=torch.int64), new_tokens))
    return out
