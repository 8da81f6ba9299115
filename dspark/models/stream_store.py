"""Labelled greedy streams, cached by content: the data the draft trains on and is measured on.

`labelled_streams` runs `greedy_streams` and adds the target's top-1 at every position, prompt positions
included, so a stream's prompt is teacher-forced real text (row t's label is the target's argmax after the
true tokens <= t) and its continuation is the serving event (there the argmax is the next token). Streams do
not depend on the draft, so each batch of prompts is stored once under `cache` (a safetensors file named by
the sha256 of the prompts, the new-token count and the target's identity; a batch missing is also looked for
as two halves, so a run with twice the batch reads the files of another) and read back by every later run:
a pilot, the full run, a rerun with another schedule and the perf scripts all pay the target once. Each file
records the seconds its generation took, so a run that reads the cache still reports the full run time.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from dspark.models.draft import target_identity
from dspark.models.streams import greedy_streams
from dspark.util.validate import check_int

Log = Callable[[str], None]
FORMAT = "dspark-streams-v1"


@dataclass(frozen=True)
class Streams:
    """Greedy streams of one batch of same-length prompts.

    tokens [n, T] int64; hidden [n, T - 1, d] float16 (the target's final-normed states, the draft's features);
    argmax [n, T - 1] int64 (the target's top-1 at positions 0..T-2); prompt_len P; seconds of target time.
    """

    tokens: Tensor
    hidden: Tensor
    argmax: Tensor
    prompt_len: int
    seconds: float

    def select(self, rows: slice | Tensor) -> "Streams":
        """The streams at `rows` (a slice or an index tensor); seconds scaled by the share kept."""
        tokens = self.tokens[rows]
        return Streams(tokens, self.hidden[rows], self.argmax[rows], self.prompt_len,
                       self.seconds * tokens.shape[0] / max(self.tokens.shape[0], 1))

    @staticmethod
    def cat(parts: list["Streams"]) -> "Streams":
        """One Streams from parts of equal prompt and stream length (seconds summed)."""
        if not parts or len({(p.prompt_len, p.tokens.shape[1]) for p in parts}) != 1:
            raise ValueError("Streams.cat needs >= 1 part, all of one prompt length and stream length")
        return Streams(torch.cat([p.tokens for p in parts]), torch.cat([p.hidden for p in parts]),
                       torch.cat([p.argmax for p in parts]), parts[0].prompt_len, sum(p.seconds for p in parts))


def _key(prompts: Tensor, new_tokens: int, identity: dict) -> str:
    h = hashlib.sha256(prompts.to(torch.int64).contiguous().numpy().tobytes())
    h.update(json.dumps({"new_tokens": new_tokens, "target": identity, "format": FORMAT}, sort_keys=True).encode())
    return h.hexdigest()[:32]


@torch.no_grad()
def _generate(model: nn.Module, prompts: Tensor, new_tokens: int) -> Streams:
    t0 = time.perf_counter()
    tokens, hidden = greedy_streams(model, prompts, new_tokens, batch=prompts.shape[0])
    p = prompts.shape[1]
    head = model.get_output_embeddings()
    top = torch.stack([head(h[: p - 1].to(head.weight.dtype)).argmax(-1) for h in hidden])  # a row at a time:
    argmax = torch.cat([top.cpu(), tokens[:, p:].cpu()], 1)                               # [P, V] each
    return Streams(tokens.cpu(), hidden.cpu().half(), argmax, p, time.perf_counter() - t0)


def labelled_streams(model: nn.Module, prompts: Tensor, new_tokens: int, *, batch: int = 64,
                     cache: Path | None = None, log: Log | None = None) -> Streams:
    """The target's greedy streams of `prompts` with its top-1 at every position, `batch` prompts at a time.

    Args:
        model: a transformers causal LM in its own attention (`greedy_streams`).
        prompts: int64 [N, P].
        new_tokens: greedy tokens after each prompt.
        batch: prompts per generation batch (and per cache file).
        cache: folder of cached batches (None: nothing cached).
        log: progress lines.
    Returns:
        Streams with tokens [N, P + new_tokens], hidden / argmax [N, P + new_tokens - 1].
    """
    check_int("batch", batch, 1)
    identity = target_identity(model) if cache is not None else {}
    parts, done = [], 0
    for chunk in prompts.split(batch):
        part = None if cache is None else _cached(Path(cache), chunk, new_tokens, identity)
        if part is None:
            part = _generate(model, chunk, new_tokens)
            if cache is not None:
                _write(Path(cache) / f"{_key(chunk, new_tokens, identity)}.safetensors", part)
        parts.append(part)
        done += chunk.shape[0]
        if log is not None:
            log(f"greedy streams {done}/{prompts.shape[0]} ({sum(p.seconds for p in parts):.0f} s of target time)")
    return Streams.cat(parts)


def _cached(cache: Path, chunk: Tensor, new_tokens: int, identity: dict, depth: int = 3) -> Streams | None:
    """The cached streams of `chunk`: its own file, or (a run with a smaller batch wrote it) both halves'."""
    path = cache / f"{_key(chunk, new_tokens, identity)}.safetensors"
    if path.is_file():
        return _read(path)
    if depth == 0 or chunk.shape[0] < 2:
        return None
    half = (chunk.shape[0] + 1) // 2
    parts = [_cached(cache, c, new_tokens, identity, depth - 1) for c in (chunk[:half], chunk[half:])]
    return None if any(p is None for p in parts) else Streams.cat(parts)  # type: ignore[arg-type]


def _write(path: Path, s: Streams) -> None:
    from safetensors.torch import save_file

    from dspark.util.fileio import atomic_write

    meta = {"format": FORMAT, "prompt_len": str(s.prompt_len), "seconds": repr(s.seconds)}
    tensors = {"tokens": s.tokens.to(torch.int32), "hidden": s.hidden, "argmax": s.argmax.to(torch.int32)}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def _read(path: Path) -> Streams | None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            return None
        t = {k: f.get_tensor(k) for k in f.keys()}
    return Streams(t["tokens"].long(), t["hidden"], t["argmax"].long(), int(meta["prompt_len"]),
                   float(meta["seconds"]))
