"""What a decoder and a run are given, checked once when built: `EngineConfig` (the decoder) and `SamplingParams`
(how a run draws its tokens)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from dspark.serve.checks import check_device, check_positive_or_none
from dspark.serve.clock import CLOCKS
from dspark.util.validate import check_int, check_real, check_type
from dspark.verify.layout import check_tiers


@dataclass(frozen=True)
class EngineConfig:
    """A decoder's settings.

    Attributes:
        cache_tokens / page_size: each model's paged KV cache (tokens over all requests, tokens per page).
        device: where the models run (`cpu` or `cuda`; a torch.device once checked).
        tiers: the captured token tiers of compact steps (strictly increasing; None or empty: eager).
        clock: how step phases are timed: `wall` (perf_counter) or, on the CPU, `thread` (this thread's CPU time,
            not charged while other processes hold the core).
        reserve_new_tokens: size the KV pages of every run for at least this many new tokens per request (a short
            profiling run then has the geometry of the long runs it times); None: each run's own count.
        keep_draft_logits: each speculative StepOutcome keeps the drafter's token logits [B, k, V].
        fold_prefill: chunked prefill: prompts admitted while other requests decode ride the next step's target
            forward (eager on any device) and their requests decode from the step after; False: every admission
            is prefilled in a forward of its own before the step.
        defer_observe: a policy that allows it (`Policy.observe_deferrable`) observes a step's outcome and
            seconds once the next step's forward is launched (its draft, or a plain step's target forward), so its
            host work can run while the device does; its decisions then read outcomes one step old. None (the
            default): on an accelerator, off on the CPU (one processor does both: nothing to overlap).
    """

    cache_tokens: int = 65536
    page_size: int = 16
    device: str | torch.device = "cpu"
    tiers: Sequence[int] | None = None
    clock: str = "wall"
    reserve_new_tokens: int | None = None
    keep_draft_logits: bool = False
    fold_prefill: bool = True
    defer_observe: bool | None = None

    def __post_init__(self) -> None:
        check_int("cache_tokens", self.cache_tokens, 1)
        check_int("page_size", self.page_size, 1)
        device = check_device(self.device)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "tiers", check_tiers(self.tiers))
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {self.clock!r}")
        if self.clock == "thread" and device.type != "cpu":
            raise ValueError(f"clock 'thread' (this thread's CPU time) times CPU work only; device is {device}")
        check_positive_or_none("reserve_new_tokens", self.reserve_new_tokens)
        check_type("keep_draft_logits", self.keep_draft_logits, bool)
        check_type("fold_prefill", self.fold_prefill, bool)
        check_type("defer_observe", self.defer_observe, bool, optional=True)

    @property
    def defers_observe(self) -> bool:
        """`defer_observe`, resolved for this device."""
        return self.device.type != "cpu" if self.defer_observe is None else self.defer_observe


@dataclass(frozen=True)
class SamplingParams:
    """How a run draws tokens.

    Attributes:
        temperature: 0 (the default): greedy, argmax (top_k, top_p and seed unused). Above 0: each token is drawn
            from softmax(logits / temperature), restricted to the `top_k` most likely tokens and the `top_p`
            nucleus when given (transformers' warps, in its order), from one generator seeded with `seed`;
            rejection sampling keeps the committed tokens distributed as the warped target's.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_real("temperature", self.temperature, 0, math.inf, high_open=True)
        if self.top_k is not None:
            check_int("top_k", self.top_k, 1)
        if self.top_p is not None:
            check_real("top_p", self.top_p, 0, 1, low_open=True)
        check_int("seed", self.seed, 0)

    @property
    def greedy(self) -> bool:
        """True at temperature 0."""
        return self.temperature == 0


GREEDY = SamplingParams()
