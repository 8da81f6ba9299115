"""The demo's configuration (`DemoConfig`, everything the demo does), its validation before any work, and the
small rules derived from it: the policy list, queue sizes, tiers, the step clock, the requests' lengths."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from dspark.config import VerifyMode
from dspark.models.draft import DraftConfig
from dspark.serve.checks import check_device, check_fits
from dspark.serve.policies import ADAPTIVE
from dspark.util.validate import check_int, check_output_path, check_real
from dspark.verify.layout import check_tiers, tier_ladder


@dataclass
class DemoConfig:
    """Everything the demo does is decided here (no environment variables)."""

    device: str = "cpu"
    out: str = "demo_out"
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    mode: str = "compact"
    policies: tuple[str, ...] = ("adaptive", "adaptive-est", "fixed", "oracle")
    gamma: int = 3              # drafts per step (the shipped draft proposes up to 6; survival past 3 is ~0.1)
    prompt_len: int = 32
    max_new_tokens: int = 12    # mean new tokens per request ...
    length_spread: float = 0.5  # ... each drawn uniformly from max_new_tokens x [1 - spread, 1 + spread]
    requests_per_slot: int = 4  # queue length N = requests_per_slot * B (continuous batching on B slots) ...
    max_requests: int = 32      # ... at most this (B = 16's rounds take the longest already) ...
    min_requests: int = 4       # ... and at least this, and B
    repeats: int = 3
    profile_repeats: int = 2  # lockstep sweeps of the step-cost profile (each point: the median of these)
    sampling: bool = False
    temperature: float = 1.0
    lag: int = 0                # synchronous decode loop: live-survival budget (1: the overlap scheduler's lag)
    probe_every: int = 8        # adaptive: plain steps in a row before a probe (a speculative step) ...
    max_probe_every: int = 64   # ... doubling while probes keep confirming plain, up to this
    cost_feedback: bool = False  # adaptive: rescale the profiled costs by measured step times (see the CLI help)
    threads: int = 1
    tiers: tuple[int, ...] | None = None  # token tiers compact steps pad to (None: `tier_ladder`; (): eager)
    clock: str = "auto"     # step timing: wall / thread (CPU time of the decoding thread); auto: see `demo_clock`
    seed: int = 0




NGRAM = "ngram-"  # the n-gram drafter's policy family: ngram-fixed-K, ngram-adaptive-est


def parse_policies(names: Sequence[str], gamma: int) -> list[str]:
    """Expand `fixed` to fixed-0..fixed-gamma and `ngram-fixed` to ngram-fixed-1..ngram-fixed-gamma; validate every
    name (fixed-k needs 0 <= k <= gamma, ngram-fixed-k 1 <= k <= gamma: its k = 0 is fixed-0)."""
    out: list[str] = []
    for name in names:
        family, base = (NGRAM, name[len(NGRAM):]) if name.startswith(NGRAM) else ("", name)
        low = 1 if family else 0
        if base == "fixed":
            out += [f"{family}fixed-{k}" for k in range(low, gamma + 1)]
        elif base in (("adaptive-est",) if family else ADAPTIVE + ("oracle",)):
            out.append(name)
        elif base.startswith("fixed-") and base[6:].isdigit():
            k = int(base[6:])
            if not low <= k <= gamma:
                raise ValueError(f"policy {name!r}: k = {k} is outside [{low}, gamma = {gamma}]")
            out.append(name)
        else:
            raise ValueError(f"unknown policy {name!r}; choose from adaptive, adaptive-est, oracle, fixed, fixed-K "
                             "(0 <= K <= gamma), and for the n-gram drafter ngram-fixed, ngram-fixed-K (1 <= K <= "
                             "gamma), ngram-adaptive-est")
    # fixed-0 (no speculation) always runs first: the speed baseline and the losslessness reference
    return ["fixed-0"] + [n for n in dict.fromkeys(out) if n != "fixed-0"]


def check_config(cfg: DemoConfig, max_seq_len: int = DraftConfig.max_seq_len) -> None:
    """Reject bad input before any work, naming the value. `max_seq_len`: the shortest the models allow (by
    default the shipped draft's, shorter than SmolLM2's)."""
    check_device(cfg.device)
    VerifyMode.parse(cfg.mode)
    for name in ("batch_sizes", "policies") + (("tiers",) if cfg.tiers is not None else ()):
        if isinstance(getattr(cfg, name), str):
            raise ValueError(f"{name} must be a sequence such as {getattr(DemoConfig, name) or (1, 2, 4)!r}, not "
                             f"the string {getattr(cfg, name)!r}")
    top = DraftConfig.gamma  # the shipped draft's block
    if isinstance(cfg.gamma, bool) or not isinstance(cfg.gamma, int) or not 1 <= cfg.gamma <= top:
        raise ValueError(f"gamma must be an int in [1, {top}] (the draft proposes {top} tokens per step), "
                         f"got {cfg.gamma!r}")
    for name, low in (("prompt_len", 3), ("max_new_tokens", 1), ("requests_per_slot", 1), ("min_requests", 1),
                      ("max_requests", 1),
                      ("repeats", 1), ("profile_repeats", 1), ("threads", 1), ("probe_every", 1),
                      ("max_probe_every", 1), ("lag", 0), ("seed", 0)):
        check_int(name, getattr(cfg, name), low)
    check_real("temperature (sampling divides the logits by it)", cfg.temperature, 0, math.inf,
               low_open=True, high_open=True)
    parse_policies(cfg.policies, cfg.gamma)
    if cfg.tiers is not None:
        check_tiers(cfg.tiers)
    if cfg.clock not in ("auto", "wall", "thread"):
        raise ValueError(f"clock must be auto, wall or thread, got {cfg.clock!r}")
    if demo_clock(cfg) == "thread" and (check_device(cfg.device).type != "cpu" or cfg.threads != 1):
        raise ValueError(f"clock 'thread' needs device cpu and threads 1 (the CPU time of the one decoding "
                         f"thread), got device {cfg.device!r}, threads {cfg.threads}")
    if not cfg.batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in cfg.batch_sizes):
        raise ValueError(f"batch sizes must be positive ints, got {list(cfg.batch_sizes)}")
    check_real("length_spread", cfg.length_spread, 0, 1, high_open=True)
    if cfg.max_probe_every < cfg.probe_every:
        raise ValueError(f"max_probe_every = {cfg.max_probe_every} must be >= probe_every = {cfg.probe_every}")
    check_fits(cfg.prompt_len, length_range(cfg.max_new_tokens, cfg.length_spread)[1], cfg.gamma + 1, max_seq_len,
               "the models'", "lower --prompt-len or --max-new-tokens (the longest request gets max_new_tokens x "
               "(1 + length_spread))")
    out = check_output_path("out", cfg.out, folder=True, beside=True)  # a temporary folder renamed onto it
    if out.is_dir() and any(out.iterdir()) and not (out / "demo.json").is_file():
        raise ValueError(f"out {str(out)!r} is a folder with other files (no demo.json from an earlier demo): the "
                         f"demo replaces its out folder as a whole, so choose a new or empty folder")


def queue_size(cfg: DemoConfig, b: int) -> int:
    """Requests in the queue served on b slots: requests_per_slot x b, at most max_requests, at least min_requests
    and b."""
    return max(min(cfg.requests_per_slot * b, cfg.max_requests), cfg.min_requests, b)


def demo_tiers(cfg: DemoConfig) -> tuple[int, ...]:
    """The configured tiers, or by default `tier_ladder` over the batch sizes: the profile then measures every
    tier a step can replay and the planner's `TieredCostModel` reads that measured table."""
    return tier_ladder(cfg.batch_sizes, cfg.gamma + 1) if cfg.tiers is None else tuple(cfg.tiers)


def demo_clock(cfg: DemoConfig) -> str:
    """`thread` on the CPU with one intra-op thread (all the work runs on the timed thread, so its CPU time
    is the step time minus the time other processes held the core), else `wall`."""
    if cfg.clock != "auto":
        return cfg.clock
    return "thread" if check_device(cfg.device).type == "cpu" and cfg.threads == 1 else "wall"


def length_range(mean: int, spread: float) -> tuple[int, int]:
    """The fewest and most new tokens a request gets: mean x [1 - spread, 1 + spread], at least 1."""
    return max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))


def request_lengths(n: int, mean: int, spread: float, seed: int) -> torch.Tensor:
    """[n] int64 new-token counts, uniform over `length_range`: a serving queue's varied output lengths, so
    requests finish (and slots refill) at different steps under every policy."""
    lo, hi = length_range(mean, spread)
    return torch.randint(lo, hi + 1, (n,), generator=torch.Generator().manual_seed(seed))
