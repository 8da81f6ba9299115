"""The requests of a decode run: their per-slot state (`Batch`) and the queue that feeds it (`Scheduler`).

A slot holds one request at a time. The scheduler admits queued requests into free slots (continuous
batching: a slot is refilled as soon as its request ends), gives every admission a new generation number
(the lag ring never hands a new request the survival of the slot's earlier one), and retires a request when
it reaches its token count or commits a stop token. The live engine and the trace replay share both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from torch import Tensor

from dspark.verify import boundary

FINISH_LENGTH, FINISH_STOP = "length", "stop"


@dataclass
class Batch:
    """Per-slot state of the requests decoding at once (S slots; host tensors unless marked device)."""

    tokens: Tensor        # [S, max_len + W] int64, device: each slot's prompt and committed tokens
    lens: Tensor          # [S] int64: committed length (the root, the last committed token, is at lens - 1)
    ends: Tensor          # [S] int64: the slot's request is done at this length
    prompt_lens: Tensor   # [S] int64
    generations: Tensor   # [S] int64, device: admission number of the slot's request
    owners: Tensor        # [S] int64: request id decoding in the slot, -1 when idle
    stopped: Tensor       # [S] bool: the request committed a stop token

    @classmethod
    def empty(cls, num_slots: int, max_len: int, device: torch.device) -> Batch:
        """S idle slots whose sequences can grow to `max_len` tokens (one spare column past it)."""
        host = dict(dtype=torch.int64)
        return cls(tokens=torch.zeros(num_slots, max_len + 1, dtype=torch.int64, device=device),
                   lens=torch.zeros(num_slots, **host), ends=torch.zeros(num_slots, **host),
                   prompt_lens=torch.zeros(num_slots, **host),
                   generations=torch.zeros(num_slots, dtype=torch.int64, device=device),
                   owners=torch.full((num_slots,), -1, **host), stopped=torch.zeros(num_slots, dtype=torch.bool))

    @property
    def num_slots(self) -> int:
        return self.lens.numel()

    def active(self) -> Tensor:
        """[B] host ids of the slots decoding, ascending."""
        return (self.owners >= 0).nonzero().squeeze(1)

    def roots(self, slots: Tensor) -> Tensor:
        """[B] device: the last committed token of each of `slots` (host ids)."""
        dev = self.tokens.device
        return self.tokens[boundary.to_device(slots, dev), boundary.to_device(self.lens[slots] - 1, dev)]

    def commit(self, slots: Tensor, tokens: Tensor, commit_lens: Tensor, stop_ids: Tensor | None) -> Tensor:
        """Append each request's committed tokens ([B, W] device, the first commit_lens [B] of each row);
        returns the host commit lengths [B]. A committed stop token ends its request there (`ends` drops to
        just past it, so tokens after it in the same step are not part of the output)."""
        dev, w = self.tokens.device, tokens.shape[1]
        cols = torch.arange(w, device=dev)
        start = boundary.to_device(self.lens[slots], dev)
        commit_dev = commit_lens.to(torch.int64)
        idx = torch.where(cols[None, :] < commit_dev[:, None], start[:, None] + cols[None, :], self.tokens.shape[1] - 1)
        self.tokens[boundary.to_device(slots, dev)[:, None].expand(-1, w), idx] = tokens
        if stop_ids is None:
            commit = torch.from_numpy(boundary.to_host(commit_dev))  # the step's commit read
        else:
            hit = torch.isin(tokens, stop_ids) & (cols[None, :] < commit_dev[:, None])
            first = torch.where(hit.any(1), hit.int().argmax(1), w)
            commit, first = torch.from_numpy(boundary.to_host(torch.stack([commit_dev, first])))
            stop_end = self.lens[slots] + first + 1
            stop = (first < w) & (stop_end <= self.ends[slots])  # a stop token within the request's count
            self.ends[slots] = torch.where(stop, stop_end, self.ends[slots])
            self.stopped[slots] |= stop
        self.lens[slots] += commit
        return commit


@dataclass
class Finished:
    """What a run produced per request (N requests)."""

    tokens: Tensor                              # [N, max_new_tokens] int64, zeros past each request's count
    num_tokens: Tensor                          # [N] int64 tokens produced (a stop token included)
    finish_reasons: list[str] = field(default_factory=list)  # per request: "length" or "stop"


class Scheduler:
    """The request queue of one run: admission into free slots, retirement at the token count or a stop id.

    prompts: N host int64 tensors [P_i] (checked: `dspark.serve.checks.check_prompts`); new_tokens [N] int64:
    tokens to generate per request; stop_ids: token ids (device) that end a request when committed;
    generations: the admission numbers to hand out.
    Request i always gets prompt i, so outputs are comparable across policies and slot counts.
    """

    def __init__(self, prompts: Sequence[Tensor], new_tokens: Tensor, stop_ids: Tensor | None,
                 generations: Iterator[int], device: torch.device) -> None:
        self.prompts, self.new_tokens, self.stop_ids = prompts, new_tokens, stop_ids
        self._generations = generations
        self.queued = 0
        n = len(prompts)
        self.result = Finished(tokens=torch.zeros(n, int(new_tokens.max()), dtype=torch.int64, device=device),
                               num_tokens=torch.zeros(n, dtype=torch.int64), finish_reasons=[""] * n)

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    def retire(self, batch: Batch) -> None:
        """Copy out and free every slot whose request is done."""
        done = ((batch.owners >= 0) & (batch.lens >= batch.ends)).nonzero().squeeze(1)
        for slot in done.tolist():
            req, start = int(batch.owners[slot]), int(batch.prompt_lens[slot])
            count = int(batch.ends[slot]) - start
            self.result.tokens[req, :count] = batch.tokens[slot, start: start + count]
            self.result.num_tokens[req] = count
            self.result.finish_reasons[req] = FINISH_STOP if bool(batch.stopped[slot]) else FINISH_LENGTH
        batch.owners[done] = -1

    def admit(self, batch: Batch) -> Tensor:
        """Fill free slots with the next queued requests (their prompts written, a new generation number);
        returns their host slot ids (possibly empty)."""
        free = (batch.owners < 0).nonzero().squeeze(1)[: self.num_requests - self.queued]
        if not free.numel():
            return free
        dev = batch.tokens.device
        reqs = range(self.queued, self.queued + free.numel())
        batch.tokens[free.to(dev)] = 0
        for slot, req in zip(free.tolist(), reqs):
            prompt = self.prompts[req]
            batch.tokens[slot, : prompt.numel()] = prompt.to(dev)
            batch.prompt_lens[slot] = batch.lens[slot] = prompt.numel()
            batch.ends[slot] = prompt.numel() + self.new_tokens[req]
        batch.owners[free] = torch.arange(self.queued, self.queued + free.numel())
        batch.stopped[free] = False
        batch.generations[free.to(dev)] = next(self._generations)
        self.queued += free.numel()
        return free
