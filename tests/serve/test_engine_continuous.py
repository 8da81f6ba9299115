"""Continuous batching: a queue of N requests on B slots, freed slots refilled at once (tiny untrained models)."""
from __future__ import annotations

import pytest
import torch

from dspark.config import VerifyMode
from dspark.models.streams import features
from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import Adaptive, FixedK, Oracle
from dspark.serve.policies.gate import GateSettings
from tests.serve.test_engine import _prompts
from tests.serve.test_engine_speculate import GAMMA, _planner

pytestmark = pytest.mark.usefixtures("one_thread")

N, SLOTS, NEW = 7, 3, 12


@pytest.fixture(scope="module")
def decoder(device) -> SpecDecoder:
    from tests.engine_models import tiny_models

    target, draft = tiny_models(gamma=GAMMA)
    return SpecDecoder(target, draft, config=EngineConfig(cache_tokens=4096, page_size=8, device=device))


@pytest.fixture(scope="module")
def reference(decoder: SpecDecoder) -> torch.Tensor:
    """Target-only greedy, every prompt at once (no slot reuse)."""
    return decoder.generate(_prompts(N, 6, seed=5), NEW, FixedK(0), mode="static").tokens


class Recording(Adaptive):
    """Adaptive policy that records admissions and what the lag ring hands each planned request."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.admitted: list[list[int]] = []
        self.plans: list[tuple[list[int], list[int], torch.Tensor, torch.Tensor]] = []
        self._last: dict[int, int] = {}  # slot -> generation it was last planned under

    def admit(self, slots: torch.Tensor) -> None:
        self.admitted.append(slots.tolist())
        super().admit(slots)

    def plan(self, confidence_logits, slots, generations, prepass=None):
        ring = self.planner.ring
        guarded = ring.read(slots, generations).cpu()
        previous = torch.tensor([self._last.get(s, g) for s, g in zip(slots.tolist(), generations.tolist())])
        stored = ring.read(slots, previous.to(generations.device)).cpu()  # under the slot's previous request
        self._last.update(zip(slots.tolist(), generations.tolist()))
        self.plans.append((slots.tolist(), generations.tolist(), guarded, stored))
        return super().plan(confidence_logits, slots, generations)


@pytest.mark.parametrize("mode", [m.value for m in VerifyMode])
def test_lossless_with_slot_reuse(decoder: SpecDecoder, reference: torch.Tensor, mode: str) -> None:
    prompts = _prompts(N, 6, seed=5)
    for policy in (FixedK(GAMMA), Oracle(GAMMA), Adaptive(_planner(device=decoder.device), lambda b: 0.004 * b, gate=GateSettings(probe_every=2))):
        out = decoder.generate(prompts, NEW, policy, mode=mode, max_batch=SLOTS)
        assert torch.equal(out.tokens, reference), (mode, policy.name)
        assert max(s.requests.numel() for s in out.steps) == SLOTS


def test_per_request_lengths(decoder: SpecDecoder, reference: torch.Tensor) -> None:
    """Varied output lengths: each request stops at its own count (zeros after), tokens as in the fixed run."""
    counts = torch.tensor([12, 3, 7, 1, 12, 5, 9])
    for policy in (FixedK(0), FixedK(GAMMA), Oracle(GAMMA)):
        out = decoder.generate(_prompts(N, 6, seed=5), counts, policy, mode="compact", max_batch=SLOTS)
        assert out.tokens.shape == (N, 12) and sum(s.useful for s in out.steps) == int(counts.sum())
        for i, c in enumerate(counts.tolist()):
            assert torch.equal(out.tokens[i, :c], reference[i, :c]) and not out.tokens[i, c:].any()
    for bad, match in ((torch.tensor([1, 2]), r"int64 \[7\]"), (counts.int(), "int64"),
                       (torch.tensor([3, 0, 1, 1, 1, 1, 1]), r"max_new_tokens\[1\] = 0 must be >= 1")):
        with pytest.raises(ValueError, match=match):
            decoder.generate(_prompts(N, 6, seed=5), bad, FixedK(1))


def test_queue_drained_exactly(decoder: SpecDecoder, reference: torch.Tensor) -> None:
    policy = Recording(_planner(device=decoder.device), None)
    out = decoder.generate(_prompts(N, 6, seed=5), NEW, policy, mode="compact", max_batch=SLOTS)
    assert torch.equal(out.tokens, reference)
    admitted = [s for batch in policy.admitted for s in batch]
    assert policy.admitted[0] == list(range(SLOTS)) and len(admitted) == N  # each request admitted once
    assert sum(s.useful for s in out.steps) == N * NEW  # every request committed exactly max_new_tokens
    sizes = [s.busy_slots for s in out.steps]  # decoding, or a refill's prompt riding the step (chunked prefill)
    assert sizes[-1] < SLOTS and sizes == sorted(sizes, reverse=True)  # full until the queue empties, then drains
    tokens, seconds = out.steady()
    busy = [s for s in out.steps if s.busy_slots == SLOTS]
    assert tokens == sum(s.useful for s in busy) and 0 < tokens < N * NEW
    assert seconds > 0 and out.seconds == pytest.approx(out.startup_seconds + sum(s.times.total for s in out.steps))
    assert sum(s.times.prefill > 0 for s in out.steps) == len(policy.admitted) - 1  # each refill timed once


def test_refilled_slot_gets_fresh_generation_and_all_ones(decoder: SpecDecoder) -> None:
    policy = Recording(_planner(device=decoder.device), None)
    decoder.generate(_prompts(N, 6, seed=5), NEW, policy, mode="compact", max_batch=SLOTS)
    last_gen: dict[int, int] = {}
    refills = 0
    for slots, gens, guarded, stored in policy.plans:
        for i, (slot, g) in enumerate(zip(slots, gens)):
            if slot in last_gen and g != last_gen[slot]:  # first step of a new request in a reused slot
                refills += 1
                assert g > last_gen[slot]
                assert torch.equal(guarded[i], torch.ones(GAMMA))  # not the old request's survival ...
                assert not torch.equal(stored[i], torch.ones(GAMMA))  # ... which the ring still holds
            elif slot in last_gen:
                assert torch.equal(guarded[i], stored[i])  # same request: its own lagged survival
            last_gen[slot] = g
    assert refills == N - SLOTS


class FirstDrafts(FixedK):
    """FixedK that keeps the confidence logits of each request's first step, by admission order."""

    def __init__(self, k: int):
        super().__init__(k)
        self.first: list[torch.Tensor] = []
        self._seen: set[tuple[int, int]] = set()

    def plan(self, confidence_logits, slots, generations, prepass=None):
        new = [(g, s, i) for i, (s, g) in enumerate(zip(slots.tolist(), generations.tolist()))
               if (s, g) not in self._seen]
        for g, s, i in sorted(new):  # admission order: by generation, then ascending slot
            self._seen.add((s, g))
            self.first.append(confidence_logits[i].cpu())
        return super().plan(confidence_logits, slots, generations)


def test_refilled_request_is_drafted_from_its_whole_prompt(decoder: SpecDecoder) -> None:
    """A refilled request's draft KV is built in the next batched draft forward (not at admission): its first
    proposal must equal the draft run densely over its prompt, for every request, refilled or not."""
    prompts = _prompts(N, 6, seed=5)
    policy = FirstDrafts(GAMMA)
    decoder.generate(prompts, NEW, policy, mode="compact", max_batch=SLOTS)
    draft = decoder.draft
    with torch.no_grad(), decoder.target.own_attention() as model:
        target_hidden = model.base_model(prompts.to(decoder.device)).last_hidden_state[:, :-1]
        hidden = draft.forward_dense(prompts.to(decoder.device), features(target_hidden))[:, -1]
        expect = draft.propose(hidden, GAMMA, prompts[:, -1].to(decoder.device))[1].cpu()
    assert len(policy.first) == N
    torch.testing.assert_close(torch.stack(policy.first), expect, rtol=1e-4, atol=1e-4)


def test_new_request_borrows_the_batchs_survival_in_the_decision(device) -> None:
    planner = _planner(device=device)
    slots, gens = torch.tensor([0, 1, 2], device=device), torch.tensor([1, 1, 2], device=device)
    planner.ring.write(slots[:2], gens[:2], torch.zeros(2, GAMMA, device=device))  # old requests: nothing survives
    plain = lambda b: b / 400.0  # noqa: E731  plain: 400 tok/s; speculative step 10 ms

    def decide(admit: bool) -> bool:
        policy = Adaptive(planner, plain)
        if admit:
            policy.admit(torch.tensor([2], device=device))
        return policy.speculate(slots, gens)

    assert decide(admit=False)  # slot 2's stale all-ones row alone: tau = 3 + 3 = 6 per 10 ms > 400 tok/s
    assert not decide(admit=True)  # new request: the others' mean survival (0): tau = 3 per 10 ms < 400 tok/s


def test_bad_max_batch(decoder: SpecDecoder) -> None:
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="max_batch"):
            decoder.generate(_prompts(2, 6), 4, FixedK(1), max_batch=bad)


@pytest.mark.parametrize("mode", ["compact", "static"])
def test_folded_prefill_rides_the_next_step_and_changes_no_token(decoder: SpecDecoder, reference: torch.Tensor,
                                                                  mode: str) -> None:
    """Chunked prefill: a refill admitted while other requests decode rides their next step's forward (no
    prefill forward of its own) and decodes from the step after; the tokens equal the run that prefills apart."""
    counts = torch.tensor([12, 3, 7, 1, 12, 5, 9])  # uneven ends: slots free up while the others decode
    apart = decoder.fork(fold_prefill=False)
    for policy in (FixedK(GAMMA), FixedK(0), Oracle(GAMMA)):
        folded = decoder.generate(_prompts(N, 6, seed=5), counts, policy, mode=mode, max_batch=SLOTS)
        alone = apart.generate(_prompts(N, 6, seed=5), counts, policy, mode=mode, max_batch=SLOTS)
        assert torch.equal(folded.tokens, alone.tokens) and torch.equal(folded.num_tokens, alone.num_tokens)
        for i, c in enumerate(counts.tolist()):
            assert torch.equal(folded.tokens[i, :c], reference[i, :c])
        rode = [s for s in folded.steps if s.prefill_folded]
        assert rode and not any(s.prefill_folded for s in alone.steps)
        seen: set[int] = set()
        for i, s in enumerate(folded.steps):
            owners = set(s.owners.tolist())
            if s.prefill_folded:  # its admissions sit the step out, then decode in the next one
                riders = set(s.folded_owners.tolist())
                assert riders and not riders & owners and not riders & seen and s.prefill_tokens == 5 * len(riders)
                assert riders <= set(folded.steps[i + 1].owners.tolist())
                assert s.busy_slots == s.requests.numel() + len(riders) <= SLOTS and s.requests.numel() >= 1
            seen |= owners | (set(s.folded_owners.tolist()) if s.prefill_folded else set())
        assert seen == set(range(N))
        # past the first wave (the run's start-up) a prompt gets a forward of its own only when nothing decodes
        for prev, s in zip(folded.steps, folded.steps[1:]):
            if s.prefill_tokens and not s.prefill_folded:
                assert not set(prev.owners.tolist()) & set(s.owners.tolist())
        assert sum(1 for s in alone.steps if s.prefill_tokens) > 0
    with pytest.raises(TypeError, match="fold_prefill must be a bool, got int: 1"):
        EngineConfig(fold_prefill=1)
