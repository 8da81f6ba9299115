"""The gate's exploration budget: a probe waits until the plain seconds since the last one pay for its extra seconds."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.serve.policies.gate import GateSettings, SpeculationGate


def _schedule(gate: SpeculationGate, plain: list[float], probe: list[float], b: int = 4,
              behind: float = 1.0) -> list[int]:
    """Drive `gate` with plain always winning, speculation `behind` plain (a fraction): plain steps take
    plain[i % len] seconds, each probe step probe[j % len]; returns the plain steps before each probe."""
    runs, run, i, j = [], 0, 0, 0
    while len(runs) < 6 and i < 5000:
        mask = gate.probe(b)
        if mask is None:
            gate.decide(b, 3, (1 - behind) * b, 1.0)  # plain at b tok/s
            gate.went_plain(1.0)
            gate.observe_seconds(plain[i % len(plain)])
            run, i = run + 1, i + 1
            continue
        runs.append(run)
        gate.observe_seconds(probe[j % len(probe)])
        run, j = 0, j + 1
    return runs


def _reference(settings_: GateSettings, plain: list[float], probe: list[float], behind: float) -> list[int]:
    """The same schedule from the rule as written: the interval doubles to its cap; with a budget and not a close
    call, a probe also waits until budget x (plain seconds since the last probe) >= the last probe's seconds
    less as many plain steps' mean seconds before it."""
    runs, interval, extra, i, j = [], settings_.probe_every, 0.0, 0, 0
    budget = settings_.probe_budget if behind > settings_.full_probe_within else None
    while len(runs) < 6 and i < 5000:
        run, spent = 0, 0.0
        while run < interval or (budget is not None and spent * budget < extra):
            spent, run, i = spent + plain[i % len(plain)], run + 1, i + 1
            if i >= 5000:
                return runs
        runs.append(run)
        extra = max(0.0, probe[j % len(probe)] - spent / run)
        interval, j = min(2 * interval, settings_.max_probe_every), j + 1
    return runs


@pytest.mark.cpu_only(reason="host arithmetic of the gate's probe schedule")
@settings(max_examples=60, deadline=None)
@given(plain=st.lists(st.floats(0.001, 0.05), min_size=1, max_size=5),
       probe=st.lists(st.floats(0.0005, 0.2), min_size=1, max_size=3),
       budget=st.one_of(st.none(), st.floats(0.01, 0.5)), every=st.integers(1, 4), most=st.integers(0, 3),
       behind=st.sampled_from([0.02, 0.3, 1.0]))
def test_probes_follow_the_budget_rule(plain, probe, budget, every, most, behind) -> None:
    s = GateSettings(probe_every=every, max_probe_every=every * 2 ** most, cost_window=None, probe_requests=None,
                     probe_budget=budget)
    assert _schedule(SpeculationGate(s), plain, probe, behind=behind) == _reference(s, plain, probe, behind)


@pytest.mark.cpu_only(reason="host arithmetic of the gate's probe schedule")
def test_an_expensive_probe_waits_for_its_budget() -> None:
    """Plain steps take 1 s, a probe 3 s: 2 s extra, at 10 % of the plain time a probe every 20 plain steps (the
    interval alone: every 2)."""
    s = GateSettings(probe_every=2, max_probe_every=2, cost_window=None, probe_requests=None, probe_budget=0.1)
    assert _schedule(SpeculationGate(s), [1.0], [3.0]) == [2, 20, 20, 20, 20, 20]
    free = GateSettings(probe_every=2, max_probe_every=2, cost_window=None, probe_requests=None, probe_budget=None)
    assert _schedule(SpeculationGate(free), [1.0], [3.0]) == [2] * 6
    cheap = GateSettings(probe_every=2, max_probe_every=2, cost_window=None, probe_requests=None, probe_budget=0.1)
    assert _schedule(SpeculationGate(cheap), [1.0], [0.5]) == [2] * 6  # no extra: the interval decides
    # a close call (speculation 3 % behind plain, within full_probe_within): probed at the interval alone
    assert _schedule(SpeculationGate(s), [1.0], [3.0], behind=0.03) == [2] * 6


@pytest.mark.cpu_only(reason="settings validation")
@pytest.mark.parametrize("value", [0.0, -0.1, 1.5, float("nan"), True])
def test_probe_budget_is_checked(value) -> None:
    with pytest.raises(ValueError, match="probe_budget"):
        GateSettings(probe_budget=value)
