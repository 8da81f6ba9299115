"""The speculate-or-not gate of the adaptive policy: when to probe, and how measured step times correct the
profiled ones.

After `probe_every` plain steps in a row the gate forces a probe at full depth (every draft position is observed
again); the interval doubles up to `max_probe_every` while probes confirm plain, and resets on a speculative step.
When the last decision put speculation more than `full_probe_within` behind plain, a probe of a batch larger
than `probe_requests` drafts for that many of its requests, in turn, while the rest decode plain in the same step
(the drafter catches up only the probed requests): a close call is probed whole, a clear one sampled. With
`cost_window`, each side's (speculative, plain) predicted seconds are rescaled by the median of its last
`cost_window` measured / predicted ratios (from three samples on: one stall cannot decide), and a probe of the
whole batch runs two speculative steps so the second, free of the draft's catch-up, is timed. With
`probe_budget`, a probe of a clear loss also waits until the plain steps since the last probe have taken at least
the last probe's measured extra seconds (its steps' seconds less as many plain steps' mean) over that fraction, or
`max_probe_wait` plain steps. Without `cost_window` and `probe_budget` no decision reads a step's time. Each step
keeps its own record (probe or plain, predicted seconds) until its seconds arrive, which may be after the next step
began (`Engine.defer_observe`). Why each rule: docs/policies.md.
"""
from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass

import torch
from torch import Tensor

from dspark.util.validate import check_int, check_real


@dataclass(frozen=True)
class GateSettings:
    """probe_every / max_probe_every: plain steps in a row before a probe (the first interval, its cap);
    cost_window: measured / predicted ratios per median (None: the profiled costs are used as they are);
    catch_up_seconds: the drafter's seconds per token it catches up beyond a request's root (a chain drafter
    runs the accepted drafts of the previous step again; 0: free), charged to each speculative step's price;
    probe_requests / full_probe_within: a probe drafts for at most `probe_requests` requests (None: the whole
    batch) unless the last decision's speculative rate was within `full_probe_within` of plain's (a fraction);
    prefill_token_seconds: the target's seconds per prompt token that rides a step's forward (chunked prefill),
    added to that step's predicted seconds before its ratio is sampled (0: unknown, such a step is not sampled);
    probe_budget / max_probe_wait: unless the last decision was within `full_probe_within` of plain, a probe waits
    until the last probe's measured extra seconds are at most `probe_budget` of the measured plain seconds since,
    or `max_probe_wait` plain steps in a row, whichever comes first, and never before the interval (None: the
    interval alone decides). A step that a prompt of unknown
    price rode is not counted."""

    probe_every: int = 8
    max_probe_every: int = 64
    cost_window: int | None = 9
    catch_up_seconds: float = 0.0
    probe_requests: int | None = 16
    full_probe_within: float = 0.05
    prefill_token_seconds: float = 0.0
    probe_budget: float | None = 0.001
    max_probe_wait: int = 1024

    @classmethod
    def probing(cls, probe: tuple[int, int, bool], catch_up_seconds: float = 0.0,
                probe_requests: int | None = 16, prefill_token_seconds: float = 0.0) -> GateSettings:
        """From (probe_every, max_probe_every, measured time on: a cost window of 9 steps and the default probe
        budget; off: no decision reads a step's time), the catch-up price, the requests per probe and the price of
        a prompt token riding a step."""
        if not (isinstance(probe, (tuple, list)) and len(probe) == 3 and isinstance(probe[2], bool)):
            raise TypeError(f"probe must be (probe_every, max_probe_every, measured time on: a bool), got {probe!r}")
        every, most, timed = probe
        return cls(every, most, 9 if timed else None, catch_up_seconds, probe_requests,
                   prefill_token_seconds=prefill_token_seconds, probe_budget=cls.probe_budget if timed else None)

    def __post_init__(self) -> None:
        check_int("probe_every", self.probe_every, 1)
        check_int("max_probe_every", self.max_probe_every, self.probe_every)
        if self.cost_window is not None:
            check_int("cost_window", self.cost_window, 1)
        check_real("catch_up_seconds", self.catch_up_seconds, 0.0, math.inf, high_open=True)
        if self.probe_requests is not None:
            check_int("probe_requests", self.probe_requests, 1)
        check_real("full_probe_within", self.full_probe_within, 0.0, math.inf, high_open=True)
        check_real("prefill_token_seconds", self.prefill_token_seconds, 0.0, math.inf, high_open=True)
        if self.probe_budget is not None:
            check_real("probe_budget (None: no budget)", self.probe_budget, 0.0, 1.0, low_open=True)
        check_int("max_probe_wait", self.max_probe_wait, 1)


@dataclass
class _StepRecord:
    """What one step was to the gate, read by its `observe_seconds`."""

    kind: str | None = None  # "plain", "probe" (a probe's step) or None (on its merits)
    pending: tuple[bool, float] | None = None  # (speculative, predicted seconds), when it is sampled


class SpeculationGate:
    """The gate's state over one run: the probe schedule, the cost ratios and the last decision."""

    def __init__(self, settings: GateSettings):
        self.settings = settings
        self.cost_ratio = {True: 1.0, False: 1.0}  # speculative? -> median of recent measured / predicted seconds
        self.decided: tuple[int, bool, int] | None = None  # (B, speculate, depth) until something changes
        self._samples = {kind: collections.deque(maxlen=settings.cost_window or 1) for kind in (True, False)}
        # per step not yet timed, oldest first: two when a step's times come after the next step began (deferred);
        # a driver that never times its steps keeps the last two, no more
        self._steps: collections.deque[_StepRecord] = collections.deque(maxlen=2)
        self._plain_run = 0  # plain steps since the last speculative step
        self._interval = settings.probe_every  # plain steps before the next probe
        self._probe_left = 0  # speculative steps of the current probe still to run
        self._probed = 0  # requests probed so far: where the next partial probe starts in the batch
        self._behind = 0.0  # how far the last decision put speculation behind plain (1 - rate ratio)
        self._plain_time, self._plain_timed = 0.0, 0  # measured seconds and count of plain steps since the last probe
        self._plain_mean: float | None = None  # their mean when the last probe started (None: none was timed)
        self._probe_time, self._probe_steps = 0.0, 0  # the last probe's timed seconds and steps
        self._probe_extra = 0.0  # its measured seconds beyond as many plain steps

    def begin(self) -> None:
        """A step starts: it gets its own record (probe or plain, its predicted seconds), read by its own
        `observe_seconds`, which may come after the next step began (a policy's feedback deferred)."""
        self._steps.append(_StepRecord())

    def _step(self) -> _StepRecord:
        """The current step's record (opened here when the caller did not `begin` one)."""
        if not self._steps:
            self._steps.append(_StepRecord())
        return self._steps[-1]

    def probe(self, b: int) -> Tensor | None:
        """Whether the probe schedule forces this step over `b` requests to speculate at full depth: None when the
        decision is the caller's, else a host bool mask [b] of the requests that draft (all of them, or
        `probe_requests` in turn through the batch positions)."""
        if self._probe_left:  # a probe's second step: timed for the realised-cost feedback
            self._probe_left -= 1
            self._step().kind = "probe"
            return torch.ones(b, dtype=torch.bool)
        s, budget = self.settings, self.settings.probe_budget
        held = (budget is not None and self._behind > s.full_probe_within  # a clear loss explores within the budget
                and self._plain_run < s.max_probe_wait and self._plain_time * budget < self._probe_extra)
        if self._plain_run < self._interval or held:
            return None
        # probe, at the full depth: every position is observed again
        self._plain_mean = self._plain_time / self._plain_timed if self._plain_timed else None
        self._plain_time, self._plain_timed, self._probe_time, self._probe_steps = 0.0, 0, 0.0, 0
        self._plain_run, self._step().kind = 0, "probe"
        self._interval = min(2 * self._interval, self.settings.max_probe_every)
        mask = None if self._behind <= self.settings.full_probe_within else self.sample(b)
        if mask is None:  # the whole batch
            self._probe_left = 0 if self.settings.cost_window is None else 1
            return torch.ones(b, dtype=torch.bool)
        return mask

    def sample(self, b: int) -> Tensor | None:
        """The next `probe_requests` of `b` requests in turn (host bool mask [b]), or None when that is all of them."""
        m = self.settings.probe_requests
        if m is None or m >= b:
            return None
        mask = torch.zeros(b, dtype=torch.bool)
        mask[(self._probed + torch.arange(m)) % b] = True
        self._probed += m
        return mask

    def forget(self) -> None:
        """What the last decision read has changed (new survival, an admission, an outcome): decide again."""
        self.decided = None

    def decide(self, b: int, depth: int, speculative_rate: float, plain_seconds: float) -> None:
        """Compare the best speculative step's predicted tokens / s with a plain step of `plain_seconds`, each
        rescaled by its measured cost ratio."""
        plain_rate = b / (plain_seconds * self.cost_ratio[False])
        rate = speculative_rate / self.cost_ratio[True]
        self._behind = 1.0 - rate / plain_rate
        self.decided = (b, rate > plain_rate, depth)

    def reset_probes(self) -> None:
        """The decision chose speculation: the probe schedule starts over."""
        self._plain_run, self._interval = 0, self.settings.probe_every
        self._plain_time, self._plain_timed, self._probe_extra = 0.0, 0, 0.0

    def expect(self, predicted: float | None) -> None:
        """A speculative step was planned, predicted to take `predicted` seconds (None: not sampled, its draft
        catches up on plain steps' tokens)."""
        self._step().pending = None if predicted is None else (True, predicted)

    def went_plain(self, predicted: float) -> None:
        """A plain step runs, predicted to take `predicted` seconds."""
        self._plain_run += 1
        step = self._step()
        step.pending, step.kind = (False, predicted), "plain"

    def observe_seconds(self, seconds: float, prefill_tokens: int = 0) -> None:
        """The step's measured seconds: one more ratio for its side; a moved median re-decides. prefill_tokens:
        prompt tokens that rode its forward, priced at `prefill_token_seconds` on top of its prediction (not
        sampled where that price is unknown)."""
        step = self._steps.popleft() if self._steps else _StepRecord()
        pending, kind, price = step.pending, step.kind, self.settings.prefill_token_seconds
        if kind is not None and not (prefill_tokens and not price):  # a prompt of unknown price: not counted
            own = max(0.0, seconds - price * prefill_tokens)  # the prompt rows' price left out
            if kind == "plain":
                self._plain_time, self._plain_timed = self._plain_time + own, self._plain_timed + 1
            elif self._plain_mean is not None:
                self._probe_time, self._probe_steps = self._probe_time + own, self._probe_steps + 1
                self._probe_extra = max(0.0, self._probe_time - self._probe_steps * self._plain_mean)
        if pending is None or self.settings.cost_window is None or (prefill_tokens and not price):
            return
        speculative, predicted = pending
        predicted += price * prefill_tokens
        samples = self._samples[speculative]
        samples.append(seconds / predicted if predicted > 0 else 1.0)
        if len(samples) >= min(3, samples.maxlen):  # a median of at least three: one stall cannot decide
            ratio = statistics.median(samples)
            if ratio != self.cost_ratio[speculative]:  # the comparison moved: decide again at the next step
                self.cost_ratio[speculative], self.decided = ratio, None
