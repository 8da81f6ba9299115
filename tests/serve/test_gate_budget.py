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
    cap = settings_.max_probe_wait
    while len(runs) < 6 and i < 5000:
        run, spent = 0, 0.0
        while run < interval or (budget is not None and run < cap and spent * budget < extra):
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
       behind=st.sampled_from([0.02, 0.3, 1.0]), wait=st.integers(0, 300))
def test_probes_follow_the_budget_rule(plain, probe, budget, every, most, behind, wait) -> None:
    s = GateSettings(probe_every=every, max_probe_every=every * 2 ** most, cost_window=None, probe_requests=None,
                     probe_budget=budget, max_probe_wait=1 + wait)
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


@pytest.mark.cpu_only(reason="host arithmetic of the gate's probe schedule")
def test_the_wait_stops_at_max_probe_wait() -> None:
    """A probe 1,000 s over plain would wait 10,000 plain steps at 10 %; max_probe_wait = 50 stops it there."""
    s = GateSettings(probe_every=2, max_probe_every=2, cost_window=None, probe_requests=None, probe_budget=0.1,
                     max_probe_wait=50)
    assert _schedule(SpeculationGate(s), [1.0], [1001.0]) == [2, 50, 50, 50, 50, 50]


@pytest.mark.cpu_only(reason="host arithmetic of the gate's probe schedule")
def test_a_two_step_probe_counts_both_steps_and_untimed_prompts_are_left_out() -> None:
    """With the cost feedback a whole-batch probe is two steps: 3 s + 2 s against two plain steps of 1 s is 3 s
    extra, 30 plain steps at 10 %. A plain step that a prompt of unknown price rode is neither timed nor in the
    mean: it still counts as a plain step in the interval."""
    gate = SpeculationGate(GateSettings(probe_every=2, max_probe_every=2, probe_requests=None, probe_budget=0.1))

    def plain(seconds: float, prompt: int = 0) -> None:
        assert gate.probe(4) is None
        gate.decide(4, 3, 0.0, 1.0)
        gate.went_plain(1.0)
        gate.observe_seconds(seconds, prompt)

    plain(1.0)
    plain(50.0, prompt=7)  # untimed: the mean stays 1 s
    for seconds in (3.0, 2.0):
        assert gate.probe(4) is not None
        gate.observe_seconds(seconds)
    for _ in range(29):
        plain(1.0)
    plain(1.0, prompt=3)  # not timed: 29 s so far
    plain(1.0)
    assert gate.probe(4) is not None  # 30 s of timed plain steps: 3 s is 10 %


@pytest.mark.cpu_only(reason="host arithmetic of the gate's probe schedule")
def test_a_speculative_decision_clears_the_budget() -> None:
    s = GateSettings(probe_every=2, max_probe_every=2, cost_window=None, probe_requests=None, probe_budget=0.1)
    gate = SpeculationGate(s)
    assert _schedule(gate, [1.0], [3.0])[:2] == [2, 20]
    gate.reset_probes()  # speculation won a decision: the next plain stretch starts over, no probe's debt carried
    assert _schedule(gate, [1.0], [0.5])[:3] == [2, 2, 2]


@pytest.mark.cpu_only(reason="settings validation")
def test_only_a_timed_gate_has_a_budget() -> None:
    assert GateSettings.probing((8, 64, True)).probe_budget == 0.001
    assert GateSettings.probing((8, 64, False)).probe_budget is None  # untimed: no decision reads a step's time


@pytest.mark.cpu_only(reason="settings validation")
@pytest.mark.parametrize("value", [0.0, -0.1, 1.5, float("nan"), True])
def test_probe_budget_is_checked(value) -> None:
    with pytest.raises(ValueError, match=r"probe_budget \(None: no budget\) must be a number in \(0, 1\]"):
        GateSettings(probe_budget=value)
    with pytest.raises(ValueError, match="max_probe_wait must be an int >= 1, got 0"):
        GateSettings(max_probe_wait=0)
