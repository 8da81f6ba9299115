"""Telemetry reports: tau bias buckets and the strict acceptance rate with its counts."""
from __future__ import annotations

import pytest

from dspark.telemetry import StepRecord, acceptance, tau_bias, timing


def _rec(batch: int, lag: int, predicted: float | None, committed: int, proposed: int, accepted: int,
         tier: int | None = None) -> StepRecord:
    return StepRecord(policy="p", mode="compact", sampling=False, batch=batch, lag=lag, tier=tier, budget=None,
                      verify_lens=[1] * batch, rows=batch + proposed, predicted_tau=predicted, committed=committed,
                      proposed=proposed, accepted=accepted, t_draft=0.1, t_plan=0.2, t_verify=0.3, t_accept=0.4,
                      host_syncs=2)


def test_tau_bias_buckets_and_values() -> None:
    recs = [_rec(4, 1, 6.0, 7, 5, 3), _rec(4, 1, 8.0, 6, 5, 2), _rec(2, 0, 3.5, 3, 2, 1), _rec(2, 0, None, 2, 0, 0)]
    out = tau_bias(recs, by=("batch", "lag"))
    assert [(o["batch"], o["lag"]) for o in out] == [(2, 0), (4, 1)]
    b2, b4 = out
    assert b2["steps"] == 1 and b2["bias"] == pytest.approx(-0.5)          # the None prediction is skipped
    assert b4["bias"] == pytest.approx(((7 - 6) + (6 - 8)) / 2)
    assert b4["relative_bias"] == pytest.approx(-0.5 / 6.5)
    assert tau_bias(recs, by=())[0]["steps"] == 3


def test_acceptance_is_strict_and_counted() -> None:
    a = acceptance([_rec(4, 1, 6.0, 7, 5, 3), _rec(4, 1, 8.0, 6, 5, 2)])
    assert a["acceptance_rate"] == pytest.approx(5 / 10)
    assert (a["accepted_drafts"], a["proposed_drafts"]) == (5, 10)
    assert a["acceptance_length"] == pytest.approx(13 / 8)
    none = acceptance([_rec(3, 0, 3.0, 3, 0, 0)])
    assert none["acceptance_rate"] is None and none["acceptance_length"] == 1.0  # no denominator: missing
    t = timing([_rec(4, 1, 6.0, 7, 5, 3)])
    assert t["seconds"] == pytest.approx(1.0) and t["rows_per_step"] == 9 and t["host_syncs_per_step"] == 2
