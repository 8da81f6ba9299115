"""The timed replay (`dspark.lab.replay.timed`): the lab's policies driving the real target and drafter forwards of
the tiny models. It commits exactly what the priced replay commits, step for step, and each step's time is
measured around the forwards it actually ran (counted through hooks on the models)."""
from __future__ import annotations

import dataclasses
import functools
import time

import pytest
import torch
from drafter_models import llama
from engine_models import VOCAB, tiny_llama, tiny_models

from dspark.cost.shipped import h100_llama8b_fitted
from dspark.lab.replay.lab import UNTIMED_PROBE, Lab
from dspark.lab.replay.record import RecordSettings, record_trace
from dspark.lab.replay.timed import TimedReplay
from dspark.lab.replay.workload import Request
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve.drafters.causal_lm import CausalLMDrafter
from dspark.serve.drafters.ngram import NgramDrafter
from dspark.serve.outcome import GenerateResult

pytestmark = pytest.mark.usefixtures("one_thread")
GAMMA, N = 4, 10
POLICIES = ["fixed-0", "fixed-2", f"fixed-{GAMMA}", "adaptive", "adaptive-est", "oracle"]


@functools.lru_cache(maxsize=None)
def _setup():
    target, draft = tiny_models(gamma=GAMMA)
    g = torch.Generator().manual_seed(7)
    requests = [Request("code" if i % 2 else "chat", torch.randint(3, VOCAB, (int(p),), generator=g), int(n))
                for i, (p, n) in enumerate(zip(torch.randint(4, 9, (N,), generator=g),
                                               torch.randint(3, 12, (N,), generator=g)))]
    trace = record_trace(target, draft, requests, draft_sha256="0" * 64,
                         settings=RecordSettings(gamma=GAMMA, max_batch=4))
    return trace, h100_llama8b_fitted(gamma=GAMMA, max_requests=8)


def _lab(tiers: bool) -> Lab:
    trace, cost = _setup()
    return Lab(trace, cost, GAMMA, temperatures=[1.0, 1.2, 0.9, 1.1], tiers=tiers, probe=UNTIMED_PROBE, fold_prefill=True)


class Forwards:
    """Every forward of a model's decoder stack: (rows, wall seconds, largest token id fed)."""

    def __init__(self, model: TransformersCausalLM) -> None:
        self.calls: list[tuple[int, float, int]] = []
        base = model.hf_model.base_model
        self._hooks = [base.register_forward_pre_hook(self._pre, with_kwargs=True),
                       base.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, module, args, kwargs) -> None:
        self._t0, self._ids = time.perf_counter(), kwargs["input_ids"]

    def _post(self, module, args, kwargs, out) -> None:
        self.calls.append((self._ids.numel(), time.perf_counter() - self._t0, int(self._ids.max())))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def _rig(device: torch.device, drafter=None, target: TransformersCausalLM | None = None) -> TimedReplay:
    """A timed replay on `device` whose target is not the trace's (random weights and an untied head, as on the
    GPU: its own greedy outcomes differ from the trace's) and a causal-LM drafter, unless given."""
    target = TransformersCausalLM(llama(2, VOCAB, seed=5)) if target is None else target
    drafter = CausalLMDrafter(llama(1, VOCAB, seed=3)) if drafter is None else drafter
    return TimedReplay(target, drafter, device=device, compile_model=False)


def _same_steps(priced: GenerateResult, timed: GenerateResult) -> None:
    assert torch.equal(priced.tokens, timed.tokens.cpu())
    assert len(priced.steps) == len(timed.steps)
    for i, (x, y) in enumerate(zip(priced.steps, timed.steps)):
        assert x.speculated == y.speculated, i
        assert torch.equal(x.owners, y.owners), i
        assert int(x.layout.total_rows) == int(y.layout.total_rows), i
        assert torch.equal(x.caps.to(torch.int64), y.caps.cpu().to(torch.int64)), (i, x.caps, y.caps)
        assert torch.equal(x.commit_lens, y.commit_lens.cpu()), i
        assert torch.equal(x.correct_lens, y.correct_lens.cpu()), i
        assert torch.equal(x.confidence_logits, y.confidence_logits.cpu()), i


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("policy", POLICIES)
def test_timed_replay_commits_what_the_priced_replay_commits_and_times_the_forwards_it_ran(
        policy: str, b: int, device: torch.device) -> None:
    lab = _lab(tiers=False)
    rig = _rig(device)
    ids = torch.arange(N)
    priced = dataclasses.replace(lab, estimators={}).run(policy, b, ids)
    target, drafter = Forwards(rig.target), Forwards(rig.drafter.model)
    try:
        timed = dataclasses.replace(lab, estimators={}).run(policy, b, ids, timed=rig)
    finally:
        target.remove()
        drafter.remove()
    _same_steps(priced, timed)
    # the forwards each step ran, in order: a prefill of its admissions, then (the oracle's untimed static
    # prepass and) the verify rows of its layout, or one row per request in a plain step; a refill's prompt rides
    # that forward instead while other requests decode (chunked prefill)
    want_target, want_drafter = [], []
    for s in timed.steps:
        n = s.requests.numel()
        riding = s.prefill_tokens if s.prefill_folded else 0
        if s.prefill_tokens and not riding:
            want_target.append(s.prefill_tokens)
        if s.speculated:
            k = s.confidence_logits.shape[1]
            want_drafter += [n + s.catch_up] + [n] * (k - 1)  # the drafter's catch-up, then one row per draft
            if policy == "oracle":
                want_target.append(n * (k + 1))
            want_target.append(int(s.layout.total_rows) + riding)
        else:
            want_target.append(n + riding)
    if b > 1:
        assert any(s.prefill_folded for s in timed.steps)
    assert [rows for rows, _, _ in target.calls] == want_target
    assert [rows for rows, _, _ in drafter.calls] == want_drafter
    spec = [s for s in timed.steps if s.speculated]
    assert len(spec) == 0 if policy == "fixed-0" else spec[0].catch_up > 0  # the first proposal caught up the prompts
    # each phase's time is measured around the forwards it ran: never less than them
    calls = iter(target.calls)
    draft_calls = iter(drafter.calls)
    for s in timed.steps:
        if s.prefill_tokens and not s.prefill_folded:
            next(calls)
        if s.speculated:
            k = s.confidence_logits.shape[1]
            assert s.times.draft >= sum(next(draft_calls)[1] for _ in range(k)) > 0
            if policy == "oracle":
                next(calls)  # the prepass: charged to no phase
        assert s.times.verify >= next(calls)[1] > 0
    assert timed.seconds == pytest.approx(timed.startup_seconds + sum(s.times.total for s in timed.steps))
    assert timed.startup_seconds >= target.calls[0][1] > 0


@pytest.mark.parametrize("policy", ["fixed-2", "adaptive"])
def test_timed_replay_replays_the_graph_tiers_the_planner_chose(policy: str, device: torch.device) -> None:
    lab = _lab(tiers=True)
    rig = _rig(device)
    ids = torch.arange(N)
    priced = dataclasses.replace(lab, estimators={}).run(policy, 4, ids)
    target = Forwards(rig.target)
    try:
        timed = dataclasses.replace(lab, estimators={}).run(policy, 4, ids, timed=rig)
    finally:
        target.remove()
    _same_steps(priced, timed)
    tiered = [s for s in timed.steps if s.speculated and not s.prefill_folded]  # a step a prompt rides runs eager
    padded = [s.layout.graph_num_tokens for s in tiered]
    assert any(p != s.layout.total_rows for p, s in zip(padded, tiered))
    # a compact step runs its tier's padded rows: every padded size the steps chose was run
    assert set(padded) <= {rows for rows, _, _ in target.calls}


def test_a_trace_of_a_larger_vocabulary_is_fed_modulo_the_models(device: torch.device) -> None:
    lab = _lab(tiers=False)
    small = TransformersCausalLM(tiny_llama(VOCAB // 4, seed=6))
    rig = _rig(device, NgramDrafter(), small)
    ids = torch.arange(N)
    assert int(lab.trace.continuation.max()) >= VOCAB // 4  # ids the small model does not have
    priced = dataclasses.replace(lab, estimators={}).run("adaptive", 4, ids)
    target = Forwards(rig.target)
    try:
        timed = dataclasses.replace(lab, estimators={}).run("adaptive", 4, ids, timed=rig)
    finally:
        target.remove()
    _same_steps(priced, timed)  # the committed tokens are the trace's own ids
    assert target.calls and max(top for _, _, top in target.calls) < VOCAB // 4


@pytest.mark.cpu_only(reason="argument checks at the public edge, before any model runs")
def test_timed_replay_refuses_bad_arguments() -> None:
    target = tiny_models(gamma=GAMMA)[0]
    with pytest.raises(TypeError, match="target"):
        TimedReplay(target.hf_model, NgramDrafter())
    with pytest.raises(TypeError, match="drafter"):
        TimedReplay(target, "ngram")
    with pytest.raises(ValueError, match="page_size"):
        TimedReplay(target, NgramDrafter(), page_size=0)
    with pytest.raises(ValueError, match="vocabulary"):
        TimedReplay(target, CausalLMDrafter(tiny_llama(VOCAB // 2, seed=3)))
    with pytest.raises(TypeError, match="timed"):
        _lab(tiers=False).run("fixed-2", 1, torch.arange(N), timed="cuda")
    short = TimedReplay(TransformersCausalLM(tiny_llama(VOCAB, seed=5, max_seq_len=8)), NgramDrafter())
    with pytest.raises(ValueError, match="max_len = .* timed target holds 8 positions"):
        _lab(tiers=False).run("fixed-2", 1, torch.arange(N), timed=short)


def test_a_timed_run_is_not_limited_by_the_batch_sizes_reality_prices(device: torch.device) -> None:
    """`reality` plays the simulator only: a timed run serves any B the planner's cost model prices."""
    trace, cost = _setup()
    lab = dataclasses.replace(_lab(tiers=False), reality=h100_llama8b_fitted(gamma=GAMMA, max_requests=2))
    with pytest.raises(ValueError, match=r"b must be in \[1, max_requests = 2\] \(the batch sizes reality "
                                         r"'h100-llama8b-fitted' prices\), got 4"):
        lab.run("fixed-2", 4, torch.arange(N))
    priced = dataclasses.replace(lab, reality=None).run("fixed-2", 4, torch.arange(N))
    _same_steps(priced, lab.run("fixed-2", 4, torch.arange(N), timed=_rig(device)))
