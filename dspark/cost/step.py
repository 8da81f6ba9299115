"""What a step is priced from (`StepWork`) and the per-B parts of a serving cost: `BatchCurve` (seconds over B,
linear between probes), `DraftCost` (the drafter's kind and seconds per depth), `PrefillCost`. `ServingCost`
(dspark.cost.serving) sums them."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dspark.cost.base import check_probes, check_values
from dspark.util.validate import check_int, check_real, check_type


@dataclass(frozen=True)
class BatchCurve:
    """Seconds of one step as a function of the batch size B: values at batch probes, linear between them."""

    batch_sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        probes = check_probes("batch_sizes", self.batch_sizes, 1)
        object.__setattr__(self, "batch_sizes", probes)
        object.__setattr__(self, "seconds", check_values("seconds", self.seconds, len(probes), True))

    def __call__(self, num_requests: int) -> float:
        """Seconds at B = num_requests, which must lie in [batch_sizes[0], batch_sizes[-1]]."""
        lo, hi = self.batch_sizes[0], self.batch_sizes[-1]
        if check_int("num_requests", num_requests, 1) < lo or num_requests > hi:
            raise ValueError(f"num_requests must be in [{lo}, {hi}] (the batch sizes this curve covers), got "
                             f"{num_requests}")
        return float(np.interp(num_requests, self.batch_sizes, self.seconds))

    def to_dict(self) -> dict[str, list]:
        """{"batch_sizes": [...], "seconds": [...]}."""
        return {"batch_sizes": list(self.batch_sizes), "seconds": list(self.seconds)}

    @classmethod
    def from_dict(cls, d: object) -> "BatchCurve":
        """Validate and rebuild from `to_dict` output."""
        if not isinstance(d, dict) or set(d) != {"batch_sizes", "seconds"}:
            raise ValueError(f"a batch curve must be a JSON object with batch_sizes and seconds, got {d!r}")
        return cls(d["batch_sizes"], d["seconds"])


DRAFTER_KINDS = ("chain", "parallel", "ngram")
KV_LAYOUTS = ("ragged", "padded")


@dataclass(frozen=True)
class DraftCost:
    """The drafter's seconds per proposal: `seconds_per_depth[k - 1](n)` for n requests drafting k tokens each,
    each catching up one token (its root), plus `per_catch_up_token` x the tokens it catches up beyond the roots.

    kind: `chain` (one forward per drafted position: EAGLE, a small causal LM, the block draft's chain steps;
    seconds never decrease with k), `parallel` (one forward whatever k: DSpark / DFlash-style block drafters;
    equal seconds at every k) or `ngram` (a host lookup, next to nothing; any shape). per_catch_up_token: seconds
    per extra row of the drafter's catch-up forward (a token committed since its last proposal other than the
    root, or a prompt token after admission).
    """

    kind: str
    seconds_per_depth: tuple[BatchCurve, ...]
    per_catch_up_token: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"drafter kind must be one of {DRAFTER_KINDS}, got {self.kind!r}")
        curves = tuple(check_type("seconds_per_depth", self.seconds_per_depth, (list, tuple)))
        if not curves:
            raise ValueError("seconds_per_depth must hold one batch curve per draft depth 1..gamma, got none")
        for k, c in enumerate(curves, 1):
            check_type(f"seconds_per_depth[{k - 1}]", c, BatchCurve)
        object.__setattr__(self, "seconds_per_depth", curves)
        check_real("per_catch_up_token", self.per_catch_up_token, 0.0, math.inf, high_open=True)
        if self.kind == "ngram":
            return
        for k in range(1, len(curves)):
            shallow, deep = curves[k - 1], curves[k]
            for b in sorted(set(shallow.batch_sizes) | set(deep.batch_sizes)):
                if not (_covers(shallow, b) and _covers(deep, b)):
                    continue
                lo, hi = shallow(b), deep(b)
                if self.kind == "chain" and hi < lo:
                    raise ValueError(f"a chain drafter pays per drafted position, but depth {k + 1} costs {hi!r} s "
                                     f"at B={b}, less than depth {k} ({lo!r} s)")
                if self.kind == "parallel" and not math.isclose(hi, lo, rel_tol=1e-9):
                    raise ValueError(f"a parallel drafter runs one forward whatever k, but depth {k + 1} costs "
                                     f"{hi!r} s at B={b} against {lo!r} s at depth {k}")

    @property
    def max_drafts(self) -> int:
        """The deepest proposal priced (gamma)."""
        return len(self.seconds_per_depth)

    def seconds(self, drafts: int, requests: int, catch_up: int = 0) -> float:
        """Seconds of `requests` requests drafting `drafts` tokens each after catching up `catch_up` tokens beyond
        their roots (0 when `drafts` or `requests` is 0)."""
        check_int("catch_up", catch_up, 0)
        if check_int("drafts", drafts, 0) == 0 or check_int("requests", requests, 0) == 0:
            return 0.0
        if drafts > self.max_drafts:
            raise ValueError(f"drafts must be in [0, {self.max_drafts}] (the depths this drafter is priced for), "
                             f"got {drafts}")
        return self.seconds_per_depth[drafts - 1](requests) + self.per_catch_up_token * catch_up

    def to_dict(self) -> dict[str, Any]:
        """{"kind": ..., "seconds_per_depth": [curve, ...], "per_catch_up_token": ...}."""
        return {"kind": self.kind, "seconds_per_depth": [c.to_dict() for c in self.seconds_per_depth],
                "per_catch_up_token": self.per_catch_up_token}

    @classmethod
    def from_dict(cls, d: object) -> "DraftCost":
        """Validate and rebuild from `to_dict` output; a missing kind is refused by name, a missing
        per_catch_up_token reads as 0 (catch-up not profiled)."""
        if not isinstance(d, dict) or "kind" not in d:
            raise ValueError(f"the drafter must name its kind, one of {DRAFTER_KINDS} (a chain drafter pays per "
                             f"drafted position, a parallel one one forward whatever k), got {d!r}")
        if not {"kind", "seconds_per_depth"} <= set(d) <= {"kind", "seconds_per_depth", "per_catch_up_token"}:
            raise ValueError(f"a drafter must hold kind, seconds_per_depth and optionally per_catch_up_token, got "
                             f"{sorted(d)}")
        curves = check_type("seconds_per_depth", d["seconds_per_depth"], list)
        return cls(d["kind"], tuple(BatchCurve.from_dict(c) for c in curves), d.get("per_catch_up_token", 0.0))


def _covers(curve: BatchCurve, b: int) -> bool:
    return curve.batch_sizes[0] <= b <= curve.batch_sizes[-1]


@dataclass(frozen=True)
class PrefillCost:
    """Seconds to prefill the prompts admitted before a step: `per_forward` once + `per_token` x their tokens (a
    forward of their own), or `per_token` x their tokens alone when they ride a decode step's forward (folded)."""

    per_forward: float
    per_token: float

    def __post_init__(self) -> None:
        for name in ("per_forward", "per_token"):
            check_real(name, getattr(self, name), 0.0, math.inf, high_open=True)

    def seconds(self, tokens: int, folded: bool = False) -> float:
        """Seconds to prefill `tokens` prompt tokens (0 when none), in a forward of their own or `folded` into a
        step's forward (no per-forward cost)."""
        if not tokens:
            return 0.0
        return self.per_token * tokens + (0.0 if folded else self.per_forward)


@dataclass(frozen=True)
class StepWork:
    """What one engine step did, as a serving cost prices it.

    requests: B, the requests decoding in the step; rows: the target's rows (the verify layout's rows before
    tier padding; B for a plain step); kv_tokens: the tokens those requests hold in the KV cache before the step
    (prompt + committed), summed; kv_longest: the most one of them holds (None: kv_tokens shared evenly); drafts:
    tokens drafted per drafting request (0: a plain step); drafting: requests that drafted; prefill_tokens: prompt
    tokens admitted (prefilled) right before the step, or with `prefill_folded` in the step's own target forward.
    """

    requests: int
    rows: int
    kv_tokens: int
    drafts: int = 0
    drafting: int = 0
    prefill_tokens: int = 0
    catch_up: int = 0
    kv_longest: int | None = None
    prefill_folded: bool = False

    def __post_init__(self) -> None:
        for name, low in (("requests", 1), ("rows", 1), ("kv_tokens", 0), ("drafts", 0), ("drafting", 0),
                          ("prefill_tokens", 0), ("catch_up", 0)):
            check_int(name, getattr(self, name), low)
        if self.drafting > self.requests:
            raise ValueError(f"drafting must be <= requests = {self.requests}, got {self.drafting}")
        check_type("prefill_folded", self.prefill_folded, bool)
        if self.kv_longest is not None:
            check_int("kv_longest", self.kv_longest, 0)
            if not self.kv_longest <= self.kv_tokens <= self.requests * self.kv_longest:
                raise ValueError(f"kv_longest must lie in [kv_tokens / requests, kv_tokens] = "
                                 f"[{self.kv_tokens / self.requests:g}, {self.kv_tokens}], got {self.kv_longest}")
        if self.catch_up and not (self.drafts and self.drafting):
            raise ValueError(f"catch_up must be 0 when no request drafts (drafts = {self.drafts}, drafting = "
                             f"{self.drafting}), got {self.catch_up}")
        top = self.requests * (self.drafts + 1)
        if not self.requests <= self.rows <= top:
            raise ValueError(f"rows must be in [requests, requests x (drafts + 1)] = [{self.requests}, {top}], got "
                             f"{self.rows}")


def kv_priced(work: StepWork, layout: str) -> float:
    """The KV tokens a step's attention reads: their sum (`ragged`: kernels that walk each request's own length) or
    B x the longest (`padded`: every request padded to the longest, as dspark's CPU torch attention does)."""
    if layout == "ragged" or work.kv_longest is None:
        return float(work.kv_tokens)
    return float(work.requests * work.kv_longest)


def prefill_from_dict(d: object) -> PrefillCost:
    """Validate and rebuild a PrefillCost from {"per_forward": ..., "per_token": ...}."""
    if not isinstance(d, dict) or set(d) != {"per_forward", "per_token"}:
        raise ValueError(f"prefill must be a JSON object with per_forward and per_token, got {d!r}")
    return PrefillCost(d["per_forward"], d["per_token"])
