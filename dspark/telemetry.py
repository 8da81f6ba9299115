"""Per-step decode telemetry and the reports of the design note's section 7.

- B. tau vs real progress: `predicted_tau = B + sum(selected survival)` against `actual = sum(commit_lens)`,
  E[actual - predicted] bucketed by batch size, lag, sampling mode and graph tier.
- Acceptance: the acceptance length AL (committed tokens per request per step) and the *strict* draft
  acceptance rate = accepted drafts / drafts put to the target, always with both counts. tau and
  (AL - 1) / gamma are never reported as an acceptance rate.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

from dspark.util.validate import check_type


@dataclass(frozen=True)
class StepRecord:
    """One decode step of one batch."""

    policy: str
    mode: str
    sampling: bool
    batch: int                 # B: requests in this planner decision
    lag: int                   # steps of lag of the survival used for the budget (0 = synchronous)
    tier: int | None           # graph tier replayed (None = eager)
    budget: int | None         # extra verify rows beyond the floor (None when no planner)
    verify_lens: list[int]     # verify lengths the accept honoured (root included)
    rows: int                  # target rows the verify forward ran (padding included)
    predicted_tau: float | None  # B + sum of selected survival (None without drafts' survival)
    committed: int             # sum(commit_lens)
    proposed: int              # drafts put to the target: sum(verify_lens - 1)
    accepted: int              # drafts accepted within the verified rows: sum(commit_lens - 1)
    t_draft: float
    t_plan: float
    t_verify: float
    t_accept: float
    host_syncs: int
    speculated: bool = True    # False: a target-only step (fixed-0, or the adaptive policy chose plain)
    t_prefill: float = 0.0     # continuous batching: prefill of requests admitted right before this step
    useful: int | None = None  # committed tokens within max_new_tokens (None: not recorded)
    folded_prefill: int = 0    # prompt tokens that rode this step's forward (chunked prefill: it ran eager)
    busy_slots: int | None = None  # slots holding a request: `batch` + those whose prompt rode it (None: unknown)
    drafted: int | None = None  # draft tokens proposed per request: the step's depth k (0: plain; None: unknown)

    @property
    def seconds(self) -> float:
        return self.t_draft + self.t_plan + self.t_verify + self.t_accept + self.t_prefill

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Bucket:
    """Running sums of actual - predicted tau for one bucket."""

    steps: int = 0
    actual: float = 0.0
    predicted: float = 0.0
    diffs: list[float] = field(default_factory=list)

    def add(self, actual: float, predicted: float) -> None:
        self.steps += 1
        self.actual += actual
        self.predicted += predicted
        self.diffs.append(actual - predicted)

    def summary(self) -> dict:
        n = self.steps
        mean = (self.actual - self.predicted) / n
        var = sum((d - mean) ** 2 for d in self.diffs) / max(n - 1, 1)
        return {
            "steps": n,
            "mean_actual": self.actual / n,
            "mean_predicted": self.predicted / n,
            "bias": mean,                                   # E[actual - predicted] per step
            "bias_stderr": math.sqrt(var / n),
            "relative_bias": mean / (self.actual / n) if self.actual else None,  # vs committed per step
        }


def _records(records: object) -> list[StepRecord]:
    """The records as a list, each one a StepRecord (TypeError naming the first that is not)."""
    out = list(check_type("records", records, Iterable))
    for i, r in enumerate(out):
        check_type(f"records[{i}]", r, StepRecord)
    return out


def tau_bias(records: Iterable[StepRecord], by: Sequence[str] = ("batch", "lag", "sampling", "tier")) -> list[dict]:
    """E[actual - predicted tau] per bucket of the given record fields (steps without a prediction skipped)."""
    fields = {f.name for f in dataclasses.fields(StepRecord)}
    for name in check_type("by", by, (list, tuple)):
        if name not in fields:
            raise ValueError(f"by must name StepRecord fields, got {name!r}; fields: {sorted(fields)}")
    buckets: dict[tuple, Bucket] = {}
    for r in _records(records):
        if r.predicted_tau is None:
            continue
        key = tuple(getattr(r, f) for f in by)
        buckets.setdefault(key, Bucket()).add(r.committed, r.predicted_tau)
    order = sorted(buckets, key=lambda k: tuple((v is None, str(type(v)), v if v is not None else 0) for v in k))
    return [dict(zip(by, key)) | buckets[key].summary() for key in order]


def acceptance(records: Sequence[StepRecord]) -> dict:
    """AL and the strict acceptance rate with their counts."""
    records = _records(records)
    req_steps = sum(r.batch for r in records)
    committed = sum(r.committed for r in records)
    proposed = sum(r.proposed for r in records)
    accepted = sum(r.accepted for r in records)
    return {
        "steps": len(records),
        "request_steps": req_steps,
        "committed": committed,
        "acceptance_length": committed / req_steps if req_steps else None,
        "proposed_drafts": proposed,
        "accepted_drafts": accepted,
        # strict: accepted / drafts the target actually verified; missing (None) when nothing was proposed
        "acceptance_rate": accepted / proposed if proposed else None,
    }


def timing(records: Sequence[StepRecord]) -> dict:
    """Total seconds per phase, rows per step, host syncs per step and the share of speculative steps."""
    records = _records(records)
    n = max(len(records), 1)
    return {
        "seconds": sum(r.seconds for r in records),
        "draft_s": sum(r.t_draft for r in records),
        "plan_s": sum(r.t_plan for r in records),
        "verify_s": sum(r.t_verify for r in records),
        "accept_s": sum(r.t_accept for r in records),
        "prefill_s": sum(r.t_prefill for r in records),
        "rows_per_step": sum(r.rows for r in records) / n,
        "host_syncs_per_step": sum(r.host_syncs for r in records) / n,
        "speculative_step_share": sum(r.speculated for r in records) / n,
    }
