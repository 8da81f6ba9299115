"""docs/replay.md's rules, re-implemented from that page in plain Python (no engine, no dspark cost code): the
queue, the loop, the price of a step and the measures give the lab's numbers for plain decoding and fixed-k, on
the shipped trace and every shipped serving cost read as JSON."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.cost.serving import load_serving_cost
from dspark.lab.replay.lab import Lab, serving_queue
from dspark.lab.replay.report import run_summary
from dspark.lab.replay.trace import DEFAULT_TRACE, load_trace

pytestmark = pytest.mark.cpu_only(reason="the trace replay runs on host tensors (a simulated target, no device work)")
COSTS = Path(__file__).resolve().parents[2] / "graphs" / "cost_models"


def verify_seconds(v: dict, b: int, m: int) -> float:
    """T(B, M) of a `verify` JSON object, by its kind's formula."""
    if v["kind"] == "additive":
        return v["bias"] + np.interp(b, v["batch_probes"], v["alpha"]) + np.interp(m, v["row_probes"], v["theta"])
    assert v["kind"] == "tiered", v["kind"]
    above = [i for i, t in enumerate(v["tiers"]) if t >= m]
    if not above:
        return math.inf
    i = above[0]
    if "table" in v:
        return float(np.interp(b, v["batch_probes"], [row[i] for row in v["table"]]))
    return v["bias"] + np.interp(b, v["batch_probes"], v["alpha"]) + v["phi"][i]


def curve(c: dict, x: int) -> float:
    return float(np.interp(x, c["batch_sizes"], c["seconds"]))


def by_the_rules(cost: dict, prompts: list[int], new: list[int], accepted: list[list[int]], queue: list[int],
                 measured: range, slots: int, k: int) -> dict[str, float]:
    """tok_s, tpot_ms_p50 / p90 and run_tok_s of fixed-k (k = 0: plain) over `queue` on `slots` slots, by
    docs/replay.md alone."""
    active: dict[int, int] = {}  # queue position -> committed tokens
    seen: dict[int, int] = {}  # queue position -> its length (prompt + committed) at its last proposal, 0 at admission
    nxt, latency, before_decoding, run_seconds, useful = 0, {}, {}, 0.0, 0
    while True:
        for q in [q for q, t in active.items() if t >= new[queue[q]]]:
            del active[q]
        admitted = []
        while len(active) < slots and nxt < len(queue):
            active[nxt], seen[nxt] = 0, 0
            admitted.append(nxt)
            nxt += 1
        if not active:
            break
        prefill_tokens = sum(prompts[queue[q]] - 1 for q in admitted)
        prefill = cost["prefill"]["per_token"] * prefill_tokens
        # prompts ride the step's forward where a prefill forward has a price of its own and others decode
        fold = cost["prefill"]["per_forward"] > 0
        decoding = {q: t for q, t in active.items() if not (fold and q in admitted)}
        if not decoding or len(decoding) == len(active):  # a forward of their own: they decode in this step
            decoding = dict(active)
            prefill += cost["prefill"]["per_forward"] if admitted else 0.0
        b = len(decoding)
        cached = [prompts[queue[q]] - 1 + t for q, t in decoding.items()]
        kv = sum(cached) if cost.get("kv_layout", "ragged") == "ragged" else b * max(cached)
        if k:
            catch_up = sum(prompts[queue[q]] + t - seen[q] - 1 for q, t in decoding.items())
            seen.update({q: prompts[queue[q]] + t for q, t in decoding.items()})
            seconds = (verify_seconds(cost["verify"], b, b * (k + 1))
                       + curve(cost["drafter"]["seconds_per_depth"][k - 1], b)
                       + cost["drafter"].get("per_catch_up_token", 0.0) * catch_up)
        else:
            seconds = curve(cost["plain_seconds"], b)
        seconds += cost["per_kv_token"] * kv + prefill
        run_seconds += seconds
        for q in active:  # a folded prompt's request is in flight too
            latency[q] = latency.get(q, 0.0) + seconds
        for q in admitted:  # the step its prompt rode, or that step's whole prefill term
            before_decoding[q] = prefill if q in decoding else seconds
        for q in decoding:
            r, t = queue[q], active[q]
            active[q] += min(accepted[r][t], k) + 1 if k else 1
            useful += min(active[q], new[r]) - t
    tokens = sum(new[queue[q]] for q in measured)
    tpot = [1e3 * (latency[q] - before_decoding[q]) / new[queue[q]] for q in measured]
    return {"tok_s": slots * tokens / sum(latency[q] for q in measured), "tpot_ms_p50": float(np.percentile(tpot, 50)),
            "tpot_ms_p90": float(np.percentile(tpot, 90)), "run_tok_s": useful / run_seconds}


@pytest.fixture(scope="module")
def trace():
    return load_trace(DEFAULT_TRACE)


@pytest.mark.parametrize("name", sorted(p.stem for p in COSTS.glob("*.json")))
@pytest.mark.parametrize("b", [1, 6])
def test_the_documented_rules_give_the_labs_numbers(trace, name: str, b: int) -> None:
    cost = json.loads((COSTS / f"{name}.json").read_text())
    prompts = trace.prompt_offsets.diff().tolist()
    new = trace.new_tokens.tolist()
    offsets = trace.position_offsets.tolist()
    acc = trace.accepted.tolist()
    accepted = [acc[offsets[r]: offsets[r + 1]] for r in range(trace.num_requests)]
    q = serving_queue(trace, b, requests_per_slot=2, fill_per_slot=2, min_requests=8)
    assert torch.equal(q.ids, torch.cat([torch.randperm(trace.num_requests, generator=torch.Generator().manual_seed(0))
                                         ])[: q.ids.numel()])  # the documented queue
    lab = Lab(trace, load_serving_cost(name, width=4), 3)
    for k in range(4):
        mine = by_the_rules(cost, prompts, new, accepted, q.ids.tolist(), q.measured, b, k)
        theirs = run_summary(lab.run(f"fixed-{k}", b, q.ids), None, q.measured)
        assert {key: theirs[key] for key in mine} == pytest.approx(mine, rel=1e-9), (name, b, k)
