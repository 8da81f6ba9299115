"""Run several decode runs interleaved step by step, so that machine noise hits them alike.

Side-by-side timings of policies run one after another are decided by when each ran: on a shared
machine (other tenants, an SMT sibling, clock changes) a whole run can be far slower than the next one
of the same policy, and even the CPU time of the decoding thread moves with it. `lockstep` advances the
runs (each on its own decoder, `SpecDecoder.fork`) one step at a time, always the one with the least
charged time so far: every run's time is spent over the same stretch of wall time, so a slow spell is
shared by all of them in proportion to their time instead of deciding a ranking. Each step is still
timed on its own (the runs' results are exactly what `generate` would return, with the same tokens).
`resumed` carries each adaptive policy's realised acceptance from one round to the next (`Adaptive.resume`).
"""
from __future__ import annotations

from typing import Hashable, Mapping

from dspark.serve.outcome import DecodeRun, GenerateResult
from dspark.serve.policies import Adaptive, Policy


def lockstep(runs: Mapping[Hashable, DecodeRun]) -> dict[Hashable, GenerateResult]:
    """Drive every run to its end, each time advancing the one with the least charged seconds so far
    (ties to the earlier key); returns the results by key, in the order of `runs`."""
    charged = {key: 0.0 for key in runs}
    results: dict[Hashable, GenerateResult] = {}
    while len(results) < len(runs):
        key = min((k for k in runs if k not in results), key=charged.__getitem__)
        try:
            step = next(runs[key])
        except StopIteration as stop:
            results[key] = stop.value
            continue
        charged[key] += step.times.total
    return {key: results[key] for key in runs}


def resumed(policies: dict[Hashable, Policy], earlier: Mapping[Hashable, Policy]) -> dict[Hashable, Policy]:
    """`policies` (fresh, one per run of a round) with each adaptive one resumed from `earlier`'s policy of the same
    key, the one that served the round before: a server's policy is warm after its first requests. Returns
    `policies`."""
    for key, policy in policies.items():
        if isinstance(policy, Adaptive):
            policy.resume(earlier[key])
    return policies
