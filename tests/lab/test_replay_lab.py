"""The trace replay drives the engine's own scheduler and policies over a recorded (here: synthetic) trace.

A synthetic trace has the structure of a recorded one: a greedy continuation per request and, at each
position, drafts that match it for a(t) leading tokens. Whatever the policy, the replay must commit exactly
the continuation; every step must commit min(a(t), cap - 1) + 1 at each request's position; the simulated
clock must charge the cost model's T(B, rows); and the same inputs must give the same run bit for bit.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.config import VerifyMode
from dspark.cost.shipped import h100_llama8b_fitted
from dspark.lab.replay.lab import UNTIMED_PROBE, Lab, queue_ids, serving_queue
from dspark.lab.replay.report import ratios, run_summary
from dspark.lab.replay.trace import Trace
from dspark.lab.replay.variants import fit_trace_temperatures
from dspark.serve.policies import FixedK

pytestmark = pytest.mark.cpu_only(reason="the trace replay runs on host tensors (a simulated target, no device work)")
GAMMA, VOCAB = 4, 50
POLICIES = ("fixed-0", "fixed-2", f"fixed-{GAMMA}", "adaptive", "adaptive-est", "oracle")


def synthetic_trace(requests: int, seed: int, gamma: int = GAMMA) -> Trace:
    """Random prompts, continuations and drafts matching the continuation for a random number of leading tokens."""
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(3, 9, (requests,), generator=g)
    news = torch.randint(2, 14, (requests,), generator=g)
    conts, drafts, accepted = [], [], []
    for n in news.tolist():
        cont = torch.randint(0, VOCAB, (n + gamma,), generator=g)
        a = torch.randint(0, gamma + 1, (n,), generator=g)
        rows = torch.stack([cont[t: t + gamma] for t in range(n)])
        noise = (rows + torch.randint(1, VOCAB, rows.shape, generator=g)) % VOCAB  # never equals the truth
        cols = torch.arange(gamma)
        drafts.append(torch.where(cols[None] < a[:, None], rows, torch.where(cols[None] == a[:, None], noise,
                                                                              torch.randint(0, VOCAB, rows.shape, generator=g))))
        conts.append(cont)
        accepted.append(a)
    n_all = int(news.sum())
    return Trace(gamma=gamma, vocab_size=VOCAB, kinds=("code", "chat", "copy"),
                 kind_ids=torch.randint(0, 3, (requests,), generator=g),
                 prompt_offsets=torch.cat([torch.zeros(1, dtype=torch.int64), plens.cumsum(0)]),
                 prompt_tokens=torch.randint(0, VOCAB, (int(plens.sum()),), generator=g),
                 position_offsets=torch.cat([torch.zeros(1, dtype=torch.int64), news.cumsum(0)]),
                 continuation=torch.cat(conts), drafts=torch.cat(drafts),
                 confidence_logits=torch.randn(n_all, gamma, generator=g) * 2,
                 features=torch.randn(n_all, gamma, 3, generator=g).abs(), accepted=torch.cat(accepted),
                 soft=torch.rand(n_all, gamma, generator=g), target_margin=torch.rand(n_all + requests * gamma, generator=g))


@functools.lru_cache(maxsize=None)
def _cost():
    """The H100 fit with a drafter that pays 20 us per token it catches up beyond the roots, and its KV term read
    padded (B x the longest request's cached tokens)."""
    cost = h100_llama8b_fitted(gamma=GAMMA, max_requests=16)
    return dataclasses.replace(cost, drafter=dataclasses.replace(cost.drafter, per_catch_up_token=20e-6),
                               kv_layout="padded")


def _lab(trace: Trace, **kw) -> Lab:
    return Lab(trace, _cost(), GAMMA, temperatures=[1.0, 1.1, 0.9, 1.2], **kw)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.sampled_from([1, 3, 8]), policy=st.sampled_from(POLICIES),
       mode=st.sampled_from(list(VerifyMode)))
def test_replay_commits_the_continuation_and_min_of_accepted_and_cap_per_step(seed, b, policy, mode) -> None:
    trace = synthetic_trace(24, seed)
    ids = queue_ids(trace, 12)
    res = _lab(trace).run(policy, b, ids, mode=mode)
    for q, i in enumerate(ids.tolist()):  # lossless: the continuation, whatever the policy
        n = int(trace.new_tokens[i])
        assert torch.equal(res.tokens[q, :n], trace.greedy(i, 0, n)), (policy, q)
        assert int(res.num_tokens[q]) == n and res.finish_reasons[q] == "length"
    pos = {q: 0 for q in range(len(ids))}  # each queued request's position, advanced by an independent walk
    for step in res.steps:
        for j, q in enumerate(step.owners.tolist()):
            a = int(trace.position(int(ids[q]), pos[q]).accepted)
            cap = int(step.caps[j])
            expect = min(a, cap - 1, step.confidence_logits.shape[1]) + 1
            assert int(step.commit_lens[j]) == expect, (policy, mode, step.caps.tolist())
            if policy == "oracle" and mode is VerifyMode.COMPACT:
                assert int(step.plan.verify_lens[j]) == min(a, GAMMA) + 1  # the oracle verifies what is accepted
            pos[q] += expect


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_replay_is_deterministic_and_charges_what_each_step_did(policy: str, fold: bool) -> None:
    trace = synthetic_trace(40, seed=3)
    ids = queue_ids(trace, 12)
    runs = [_lab(trace, fold_prefill=fold).run(policy, 6, ids) for _ in range(2)]
    a, b = runs
    assert len(a.steps) == len(b.steps) and a.seconds == b.seconds
    for x, y in zip(a.steps, b.steps):
        assert torch.equal(x.caps, y.caps) and torch.equal(x.commit_lens, y.commit_lens)
        assert x.times.total == y.times.total
    cost = _cost()
    prompt = trace.prompt_offsets.diff()
    pos: dict[int, int] = {}  # queued request -> tokens committed so far, walked independently of the engine
    seen: dict[int, int] = {}  # queued request -> its length at its last proposal (0: admitted, nothing drafted)
    charged = 0.0
    folds = 0
    for s in a.steps:
        owners = s.owners.tolist()
        folded = s.folded_owners.tolist() if s.prefill_folded else []  # prompts riding this step's forward
        new = [q for q in owners if q not in pos]
        assert not (new and folded) and not set(folded) & set(pos) and not set(folded) & set(owners)
        for q in new + folded:
            pos[q], seen[q] = 0, 0
        # the prompts admitted right before this step (the first step admits the first B at start-up), in a forward
        # of their own, or riding the step's forward without its per-forward cost
        prefill = cost.prefill.seconds(sum(int(prompt[ids[q]]) - 1 for q in new + folded), folded=bool(folded))
        own = 0.0 if folded else prefill
        assert (s.times.prefill if s is not a.steps[0] else a.startup_seconds) == pytest.approx(own, abs=1e-15)
        n, k = len(owners), s.confidence_logits.shape[1]
        kv = n * max(int(prompt[ids[q]]) - 1 + pos[q] for q in owners)  # padded: B x the longest cached
        rows = int(s.layout.total_rows) if s.speculated else n
        target = float(cost.verify.step_seconds(num_requests=n, rows=rows)) if k else cost.plain_seconds(n)
        assert s.times.verify == pytest.approx(target + cost.per_kv_token * kv + prefill - own, rel=1e-12)
        folds += bool(folded)
        catch_up = sum(int(prompt[ids[q]]) + pos[q] - seen[q] - 1 for q in owners) if k else 0
        if k:
            seen.update({q: int(prompt[ids[q]]) + pos[q] for q in owners})
        draft = cost.draft_seconds(n, k) + cost.drafter.per_catch_up_token * catch_up if k else 0.0
        assert s.catch_up == catch_up
        assert s.times.draft == pytest.approx(draft, rel=1e-12, abs=1e-15)
        if k:  # a policy drafting k pays for k, not for the trace's gamma
            assert s.times.draft < cost.draft_seconds(n, GAMMA, catch_up) or k == GAMMA
        for q, c in zip(owners, s.commit_lens.tolist()):
            pos[q] += c
        charged += target + cost.per_kv_token * kv + draft + prefill
    assert a.seconds == pytest.approx(charged, rel=1e-9) and (folds > 0) == fold


def test_a_recycled_queue_repeats_every_request_before_any_twice_and_refuses_past_max_repeats() -> None:
    trace = synthetic_trace(10, seed=1)
    ids = queue_ids(trace, 24)
    assert ids.numel() == 24
    assert sorted(ids[:10].tolist()) == list(range(10)) and sorted(ids[10:20].tolist()) == list(range(10))
    assert torch.equal(ids, queue_ids(trace, 24)) and not torch.equal(ids, queue_ids(trace, 24, seed=1))
    with pytest.raises(ValueError, match="a queue of 64 requests needs 7 copies .* past max_repeats = 6"):
        queue_ids(trace, 64, max_repeats=6)
    q = serving_queue(trace, 3, requests_per_slot=2, fill_per_slot=1, min_requests=4)
    assert q.ids.numel() == 3 + 6 + 3 and q.measured == range(3, 9)
    with pytest.raises(ValueError, match="a queue of 1300 requests needs 130 copies .* max_repeats = 8"):
        serving_queue(trace, 100)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 1000), b=st.sampled_from([2, 3, 5]), policy=st.sampled_from(POLICIES), fold=st.booleans())
def test_every_measured_request_runs_at_full_concurrency_and_tok_s_is_their_tokens_over_time(seed, b, policy,
                                                                                            fold) -> None:

    trace = synthetic_trace(30, seed)
    q = serving_queue(trace, b, requests_per_slot=3, fill_per_slot=4, min_requests=6)
    res = _lab(trace, fold_prefill=fold).run(policy, b, q.ids)
    out = run_summary(res, None, q.measured)
    assert out["full_concurrency"] and out["requests"] == len(q.measured)
    assert out["tokens"] == int(trace.new_tokens[q.ids[q.measured.start:q.measured.stop]].sum())
    # brute force: each measured request's latency is the seconds of the steps it was in, decoding or prefilling
    latency = 0.0
    for i, s in enumerate(res.steps):
        riding = s.folded_owners.tolist() if s.prefill_folded else []
        inside = sum(1 for o in s.owners.tolist() + riding if o in q.measured)
        latency += inside * s.times.total
    assert out["tok_s"] == pytest.approx(b * out["tokens"] / latency, rel=1e-9)
    # a prefill forward of its own for each step that a request joins without having ridden an earlier one (with a
    # prompt of 2+ tokens: the root is a row); each step a prompt rides counted apart
    seen: set[int] = set()
    forwards = folds = 0
    for s in res.steps:
        new = [o for o in s.owners.tolist() if o not in seen]
        forwards += any(trace.prompt(int(q.ids[o])).numel() > 1 for o in new)
        seen.update(new)
        if s.prefill_folded:
            seen.update(s.folded_owners.tolist())
            folds += 1
    assert out["prefill_forwards"] == forwards > 0 and out["prefills_folded"] == folds and (folds > 0) == fold


def test_a_queue_naming_a_request_the_trace_lacks_is_refused_naming_it() -> None:
    trace = synthetic_trace(10, seed=1)
    with pytest.raises(ValueError, match=r"ids\[2\] = 10 is not a request of the trace \(it holds 0..9\)"):
        _lab(trace).run("fixed-1", 2, torch.tensor([0, 3, 10, 1]))


def test_fixed_k_rows_and_static_mode_price_every_row() -> None:
    trace = synthetic_trace(30, seed=5)
    res = _lab(trace).run("fixed-2", 4, queue_ids(trace, 8), mode=VerifyMode.STATIC)
    assert all(int(s.layout.total_rows) == s.requests.numel() * 3 for s in res.steps)


@pytest.mark.parametrize("policy", ["fixed-0", "fixed-2", "adaptive"])
def test_a_host_price_is_charged_to_every_speculative_step_and_nothing_else(policy: str) -> None:
    trace = synthetic_trace(30, seed=8)  # UNTIMED_PROBE: no decision of adaptive's reads a step's time
    ids, price = queue_ids(trace, 10), 0.0125
    base = _lab(trace, probe=UNTIMED_PROBE).run(policy, 3, ids)
    priced = _lab(trace, probe=UNTIMED_PROBE, host_seconds=price).run(policy, 3, ids)
    assert len(base.steps) == len(priced.steps) and torch.equal(base.tokens, priced.tokens)
    for a, b in zip(base.steps, priced.steps):
        extra = price if a.speculated else 0.0
        assert b.times.plan == pytest.approx(a.times.plan + extra, abs=1e-12)
        assert b.times.total == pytest.approx(a.times.total + extra, abs=1e-12)
    spec = sum(s.speculated for s in base.steps)
    assert spec == {"fixed-0": 0, "fixed-2": len(base.steps)}.get(policy, spec) and (policy == "fixed-0" or spec > 0)
    assert priced.seconds == pytest.approx(base.seconds + price * spec, rel=1e-12)


def test_a_negative_host_price_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="host_seconds"):
        _lab(synthetic_trace(10, seed=1), host_seconds=-1e-3)


def test_lab_refuses_a_cost_model_of_another_width_and_a_gamma_past_the_trace() -> None:
    trace = synthetic_trace(10, seed=1)
    with pytest.raises(ValueError, match="W = 5 but the policies verify W = gamma \\+ 1 = 3"):
        Lab(trace, _cost(), 2)
    with pytest.raises(ValueError, match="gamma = 6 exceeds the trace's recorded block of 4"):
        Lab(trace, _cost(), 6)


def test_the_adaptive_policy_drafts_shallower_when_deep_drafts_cost_more_than_they_bring() -> None:
    import dataclasses

    from dspark.cost.serving import BatchCurve, DraftCost

    trace = synthetic_trace(40, seed=11)
    base = _cost()
    steep = DraftCost("chain", tuple(BatchCurve((1, 16), (s, s)) for s in (1e-4, 3e-2, 6e-2, 9e-2)))
    cost = dataclasses.replace(base, drafter=steep)
    q = serving_queue(trace, 4, requests_per_slot=4, fill_per_slot=2, min_requests=8)
    runs = {depth: Lab(trace, cost, GAMMA, temperatures=[1.0, 1.1, 0.9, 1.2], choose_depth=depth).run(
        "adaptive", 4, q.ids) for depth in (False, True)}
    drafted = [s.confidence_logits.shape[1] for s in runs[True].steps if s.speculated]
    assert all(s.confidence_logits.shape[1] == GAMMA for s in runs[False].steps if s.speculated)
    assert drafted.count(1) > 0.6 * len(drafted)  # probes and the first steps draft gamma
    tok = {d: run_summary(r, None, q.measured)["tok_s"] for d, r in runs.items()}
    assert tok[True] > 1.1 * tok[False]
    for q_, i in enumerate(q.ids.tolist()):  # still lossless
        n = int(trace.new_tokens[i])
        assert torch.equal(runs[True].tokens[q_, :n], trace.greedy(i, 0, n))


def test_a_lab_refuses_a_table_profiled_with_another_draft_naming_both() -> None:
    import dataclasses

    trace = synthetic_trace(10, seed=1)
    trace.meta["draft_sha256"] = "0" * 64
    other = dataclasses.replace(_cost(), parameters={**_cost().parameters, "draft_sha256": "f" * 64})
    with pytest.raises(ValueError, match=f"cost .* was profiled with the draft of sha256 {'f' * 64}, but the trace "
                                         f"was recorded with {'0' * 64}"):
        Lab(trace, other, GAMMA)
    with pytest.raises(ValueError, match="reality .* was profiled with the draft of sha256"):
        Lab(trace, _cost(), GAMMA, reality=other)
    Lab(trace, dataclasses.replace(other, parameters={**other.parameters, "draft_sha256": "0" * 64}), GAMMA)


def test_the_lab_folds_refills_where_a_prefill_forward_has_a_price_of_its_own() -> None:
    trace = synthetic_trace(30, 2)
    ids = serving_queue(trace, 3, requests_per_slot=3, fill_per_slot=2, min_requests=6).ids
    free = _cost()  # the H100 fit: prefill priced per token alone (vLLM's chunked prefill decodes in the same step)
    priced = dataclasses.replace(free, prefill=dataclasses.replace(free.prefill, per_forward=1e-3))
    assert free.prefill.per_forward == 0
    for cost, folds in ((free, False), (priced, True)):
        res = Lab(trace, cost, GAMMA).run("fixed-1", 3, ids)
        assert any(s.prefill_folded for s in res.steps) == folds
        assert any(s.prefill_folded for s in Lab(trace, cost, GAMMA, fold_prefill=True).run("fixed-1", 3, ids).steps)
    with pytest.raises(TypeError, match="fold_prefill must be a bool or None, got str"):
        Lab(trace, free, GAMMA, fold_prefill="yes")


def test_the_labs_adaptive_gate_is_the_librarys_default_with_the_catch_up_priced() -> None:
    """The lab judges the gate users get (`GateSettings()`: probes 8 -> 64, measured-cost feedback on), charged the
    drafter's catch-up and a prompt riding a step at the serving cost's prices; `UNTIMED_PROBE` turns off only what
    reads a step's time (the cost feedback, the probe budget)."""
    from dspark.lab.replay.lab import UNTIMED_PROBE
    from dspark.serve.policies.gate import GateSettings

    lab = _lab(synthetic_trace(4, 0))
    policy = lab.policy("adaptive", 2)
    per_token = lab.cost.prefill.per_token
    assert per_token > 0 and policy.gate.settings == GateSettings(catch_up_seconds=20e-6,
                                                                  prefill_token_seconds=per_token)
    untimed = dataclasses.replace(lab, probe=UNTIMED_PROBE).policy("adaptive", 2).gate.settings
    assert untimed == GateSettings(cost_window=None, catch_up_seconds=20e-6, prefill_token_seconds=per_token,
                                   probe_budget=None)


def test_a_resumed_adaptive_policy_skips_the_warm_up_and_keeps_its_own_copy() -> None:
    """A policy resumed from an earlier run at the same B chooses its depth from the carried averages at its first
    speculative decision (a fresh one drafts gamma until every position has prior_weight outcomes), carries the
    whole realised-acceptance state, and learns on without touching the earlier policy's."""
    from dspark.serve.policies.adaptive import FeedbackSettings

    trace = synthetic_trace(24, 3)
    lab, ids = _lab(trace), queue_ids(trace, 12)
    first = lab.policy("adaptive", 2)
    lab.run(first, 2, ids)
    assert min(first.feedback.counts) >= first.feedback_settings.prior_weight
    state = ("mean", "counts", "totals", "predicted", "prior")
    before = {k: copy.deepcopy(getattr(first.feedback, k)) for k in state}

    def first_rates(policy) -> list[float]:
        rates, decide = [], policy.gate.decide
        policy.gate.decide = lambda b, depth, rate, plain: (rates.append(rate), decide(b, depth, rate, plain))
        lab.run(policy, 2, ids)
        return rates[:1]

    fresh, warm = lab.policy("adaptive", 2), lab.policy("adaptive", 2)
    warm.resume(first)
    assert warm.feedback is not first.feedback
    assert all(getattr(warm.feedback, k) == before[k] for k in state)
    assert first_rates(fresh) == [float("inf")]  # the warm-up: gamma, priced as certain to pay
    assert first_rates(warm)[0] < float("inf")  # chosen from the realised averages
    assert all(getattr(first.feedback, k) == before[k] for k in state)  # untouched
    assert warm.feedback.counts != before["counts"]  # it learned on
    other_depths = dataclasses.replace(lab, choose_depth=False).policy("adaptive", 2)
    other_feedback = lab.policy("adaptive", 2)
    other_feedback.feedback_settings = FeedbackSettings(decay=0.9)
    for other in (other_depths, other_feedback, lab.policy("adaptive-est", 2)):
        with pytest.raises(ValueError, match=r"resume needs a policy with the same \(draft depths, feedback"):
            lab.policy("adaptive", 2).resume(other)


class _EveryOther(FixedK):
    """Fixed-2 that decodes plain at every other step: speculative and plain steps follow each other."""

    def __init__(self) -> None:
        super().__init__(2)
        self.steps = 0

    def speculate(self, slots, generations) -> bool:
        self.steps += 1
        return self.steps % 2 == 1


@pytest.mark.parametrize("policy", ["fixed-2", "adaptive", "every other"])
def test_a_deferred_host_price_overlaps_the_forward_its_hooks_wait_for(policy: str) -> None:
    """With `defer_observe` a step's hooks run once the next step's forward is launched: after a speculative step
    that forward's phase (the next draft, or a plain step's target forward) lasts the longer of its device time
    and the deferred price; the critical price stays in the plan phase. UNTIMED_PROBE: no decision reads a time."""
    trace = synthetic_trace(30, seed=8)
    ids = queue_ids(trace, 10)

    def run(**kw):
        return _lab(trace, probe=UNTIMED_PROBE, defer_observe=True, **kw).run(
            _EveryOther() if policy == "every other" else policy, 3, ids)

    def forward(s) -> float:  # the phase a step's held hooks overlap: its draft, or a plain step's forward
        return s.times.draft if s.speculated else s.times.verify

    base = run()
    waited = sorted(forward(s) for s, before in zip(base.steps[1:], base.steps) if before.speculated)
    price = waited[len(waited) // 2]  # outlasts half of them: both sides of the overlap are taken
    priced = run(host_seconds=1e-3, deferred_host_seconds=price)
    assert len(base.steps) == len(priced.steps) and torch.equal(base.tokens, priced.tokens)
    overlapped = {True: 0, False: 0}  # after a speculative step, the price outlasted: a draft / a plain forward
    for i, (a, b) in enumerate(zip(base.steps, priced.steps)):
        assert a.speculated == b.speculated
        after_spec = i > 0 and base.steps[i - 1].speculated
        expect = max(forward(a), price) if after_spec else forward(a)
        assert forward(b) == pytest.approx(expect, abs=1e-12), i
        assert b.times.plan == pytest.approx(a.times.plan + (1e-3 if a.speculated else 0.0), abs=1e-12), i
        overlapped[a.speculated] += after_spec and forward(a) < price
    assert overlapped[policy != "every other"] > 0


def test_a_deferred_host_price_without_deferred_hooks_is_refused_naming_it() -> None:
    trace = synthetic_trace(10, seed=1)
    with pytest.raises(ValueError, match="deferred_host_seconds = 0.001 prices the hooks defer_observe=True"):
        _lab(trace, deferred_host_seconds=1e-3)
    with pytest.raises(ValueError, match="deferred_host_seconds"):
        _lab(trace, defer_observe=True, deferred_host_seconds=-1.0)
    with pytest.raises(TypeError, match="defer_observe must be a bool, got str"):
        _lab(trace, defer_observe="yes")


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda t: _lab(t, lag=-1), ValueError, "lag must be an int >= 0, got -1"),
    (lambda t: _lab(t, lag=True), ValueError, "lag must be an int >= 0, got True"),
    (lambda t: _lab(t, tiers="no"), TypeError, "tiers must be a bool, got str: 'no'"),
    (lambda t: _lab(t, choose_depth=1), TypeError, "choose_depth must be a bool, got int: 1"),
    (lambda t: _lab(t, price_catch_up=None), TypeError, "price_catch_up must be a bool, got NoneType"),
    (lambda t: _lab(t, context=math.nan), ValueError, "context must be a number in [0, inf), got nan"),
    (lambda t: _lab(t, context=-1.0), ValueError, "context must be a number in [0, inf), got -1.0"),
    (lambda t: _lab(t, reality="h100"), TypeError, "reality must be a ServingCost or None, got str: 'h100'"),
    (lambda t: _lab(t, estimators=None), TypeError, "estimators must be a dict, got NoneType: None"),
    (lambda t: _lab(t, probe=None), TypeError, "probe must be (probe_every, max_probe_every, measured time on"),
    (lambda t: _lab(t, probe=(8, 64, "no")), TypeError, "got (8, 64, 'no')"),
    (lambda t: Lab(t, _cost(), GAMMA, temperatures=torch.ones(2, GAMMA)), ValueError,
     f"temperatures must be 1-D [gamma], got shape (2, {GAMMA})"),
    (lambda t: _lab(t, probe=(0, 64, True)), ValueError, "probe_every must be an int >= 1, got 0"),
    (lambda t: _lab(t, probe_requests=0), ValueError, "probe_requests must be an int >= 1, got 0"),
    (lambda t: Lab(t, _cost(), GAMMA, temperatures=[1.0, 1.1, math.nan, 1.2]), ValueError,
     "temperatures[2] must be a number in (0, inf), got nan"),
    (lambda t: Lab(t, _cost(), GAMMA, temperatures=[1.0, 1.1, 0.9, 1.2, -1.0]), ValueError,
     "temperatures[4] must be a number in (0, inf), got -1.0"),
    (lambda t: Lab(t, _cost(), GAMMA, temperatures=3), TypeError, "temperatures must be a list or tuple or Tensor"),
    (lambda t: _lab(t).run("fixed-1", 0, torch.arange(4)), ValueError, "b must be an int >= 1, got 0"),
    (lambda t: _lab(t).run("fixed-1", 2.5), ValueError, "b must be an int >= 1, got 2.5"),
    (lambda t: _lab(t).run("fixed-1", 17, torch.arange(4)), ValueError, "b must be in [1, max_requests = 16]"),
    (lambda t: _lab(t).policy("adaptive", 17), ValueError, "b must be in [1, max_requests = 16]"),
    (lambda t: _lab(t).run("fixed-1", 2, torch.arange(4), mode="compact"), TypeError,
     "mode must be a VerifyMode, got str: 'compact'"),
    (lambda t: _lab(t).run(None, 2, torch.arange(4)), TypeError, "policy must be a Policy, got NoneType: None"),
    (lambda t: _lab(t).run(f"fixed-{GAMMA + 1}", 2, torch.arange(4)), ValueError,
     f"policy 'fixed-{GAMMA + 1}' drafts {GAMMA + 1} tokens, past the lab's gamma = {GAMMA}"),
    (lambda t: queue_ids(t, 4, seed=-1), ValueError, "seed must be an int >= 0, got -1"),
    (lambda t: queue_ids(t, 4, seed=2**64), ValueError, "seed must be in [0, "),
    (lambda t: queue_ids(None, 4), TypeError, "trace must be a Trace, got NoneType"),
    (lambda t: fit_trace_temperatures(t, GAMMA + 1), ValueError,
     f"gamma must be in [1, {GAMMA}] (the trace's recorded"),
    (lambda t: ratios({}), ValueError, "cells must hold at least one fixed-k policy's run_summary, got []"),
    (lambda t: run_summary(_lab(t).run("fixed-1", 2, torch.arange(4)), None, range(3, 9)), ValueError,
     "measured must be a non-empty range of the run's queue positions 0..3, got range(3, 9)"),
    (lambda t: run_summary(_lab(t).run("fixed-1", 2, torch.arange(4)), None, range(0)), ValueError,
     "measured must be a non-empty range"),
    (lambda t: run_summary(_lab(t).run("fixed-2", 2, torch.arange(4)), [1.0], range(2, 4)), ValueError,
     "temperatures must hold 2 values (one per draft position), got [1.0]"),
])
def test_bad_lab_settings_runs_and_queues_are_refused_naming_the_value(make, error, message) -> None:
    with pytest.raises(error) as err:
        make(synthetic_trace(10, 0))
    assert message in str(err.value)
