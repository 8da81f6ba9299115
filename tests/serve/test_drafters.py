"""The drafters behind `SpecDecoder`: the block draft, the n-gram drafter (`NgramDrafter`) and a small causal LM
(`CausalLMDrafter`). Every drafter x every policy x every verify mode commits exactly transformers' own
`generate(do_sample=False)` at B = 1, 4 and 16, with prompts of different lengths, per-request token counts and
stop ids (continuous batching refills slots); the n-gram rule equals a plain-Python reference; a causal-LM
drafter that is the target itself is always fully accepted (its KV catch-up after plain steps and refills is
exact); a drafter of another vocabulary or tokenizer is refused, naming it."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dspark.calibration.online import OnlineAcceptanceEstimator
from dspark.config import ScheduleConfig, VerifyMode
from dspark.cost import StepsPerSecondTable
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.plan.planner import PlannerSettings, VerifyPlanner
from dspark.serve.config import EngineConfig
from dspark.serve.drafters.causal_lm import CausalLMDrafter
from dspark.serve.drafters.ngram import NO_MATCH, NgramDrafter, lookup
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import Adaptive, FixedK, Oracle, Policy
from dspark.serve.policies.gate import GateSettings
from tests.drafter_models import VOCAB, llama, target_and_draft_lm, word_tokenizer
from tests.engine_models import PartialFixedK, tiny_models

pytestmark = pytest.mark.usefixtures("one_thread")

GAMMA = 3
QUEUE = {1: 2, 4: 6, 16: 16}  # slots -> requests served on them


def reference_lookup(x: list[int], k: int, n_min: int, n_max: int) -> tuple[list[int], list[list[float]]]:
    """The n-gram rule of dspark.serve.drafters.ngram, one request, in plain Python."""
    last = len(x) - 1
    match = [0] * last  # match length ending at each earlier position
    for j in range(last):
        while match[j] < n_max and j - match[j] >= 0 and x[j - match[j]] == x[last - match[j]]:
            match[j] += 1
    best = max(match, default=0)
    if best < n_min:
        return [x[last]] * k, [[NO_MATCH, 0.0, 0.0]] * k
    ends = [j for j in range(last) if match[j] == best]
    j_star = ends[-1]
    ext = list(x)
    for i in range(k):
        ext.append(ext[j_star + 1 + i])  # the continuation, read on into the proposals themselves
    drafts, feats, before = ext[last + 1:], [], len(ends)
    for i in range(k):
        support = sum(ext[j + 1: j + 2 + i] == drafts[: i + 1] for j in ends)
        feats.append([math.log((support + 0.5) / (before - support + 0.5)), float(best), math.log(last - j_star)])
        before = support
    return drafts, feats


@st.composite
def token_rows(draw):
    vocab = draw(st.integers(2, 5))  # a small vocabulary: repeats, ties of several ends, loops
    rows = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=14), min_size=1, max_size=4))
    n_min = draw(st.integers(1, 3))
    return rows, draw(st.integers(1, 5)), n_min, draw(st.integers(n_min, 4))


@given(case=token_rows())
def test_ngram_lookup_equals_the_reference(case, device) -> None:
    rows, k, n_min, n_max = case
    width = max(map(len, rows)) + 3
    tokens = torch.tensor([r + [7] * (width - len(r)) for r in rows])  # garbage past each length is ignored
    drafts, feats = lookup(tokens.to(device), torch.tensor([len(r) for r in rows], device=device), k, n_min, n_max)
    for r, row in enumerate(rows):  # each row alone: its batch mates (other lengths, other tokens) change nothing
        want_drafts, want_feats = reference_lookup(row, k, n_min, n_max)
        assert drafts[r].tolist() == want_drafts
        torch.testing.assert_close(feats[r].cpu(), torch.tensor(want_feats, dtype=torch.float32), rtol=1e-6, atol=1e-6)


def test_ngram_lookup_examples(device) -> None:
    def run(x: list[int], k: int, n_min: int, n_max: int) -> tuple[list, torch.Tensor]:
        drafts, feats = lookup(torch.tensor([x], device=device), torch.tensor([len(x)], device=device), k, n_min, n_max)
        return drafts.tolist(), feats[0].cpu()

    drafts, feats = run([5, 1, 2, 3, 9, 1, 2], 4, 1, 3)  # "1 2" ends at 2, followed by "3 9 1 2 ..."
    assert drafts == [[3, 9, 1, 2]] and feats[0, 1:].tolist() == [2.0, pytest.approx(math.log(4))]
    assert run([4, 8, 8, 8], 3, 1, 2)[0] == [[8, 8, 8]]  # a loop of period 1, repeated for every position
    drafts, feats = run([1, 2, 3], 2, 1, 2)
    assert drafts == [[3, 3]] and feats.tolist() == [[NO_MATCH, 0.0, 0.0]] * 2


def _planner(device: torch.device) -> VerifyPlanner:
    cost = StepsPerSecondTable([1, 8, 16], [100.0, 90.0, 70.0], width=GAMMA + 1)
    return VerifyPlanner(ScheduleConfig(gamma=GAMMA), cost, PlannerSettings(lag=1, num_slots=16), device=device)


def _policies(device: torch.device) -> dict[str, Policy]:
    """One fresh policy of each kind; the adaptive ones also decide speculate-or-not (plain steps happen)."""
    plain = lambda b: 1 / 104.0  # noqa: E731  (a speculative step pays from 1.04 tokens per request)
    est = OnlineAcceptanceEstimator(GAMMA, refit_every=2, min_labels=4)
    probes = GateSettings(probe_every=1, max_probe_every=1, cost_window=None, probe_requests=1)
    return {"fixed-3": FixedK(GAMMA), "adaptive": Adaptive(_planner(device), plain),
            "partial-3": PartialFixedK(GAMMA),  # drafts for every other request, verifies k + 1 rows for all
            "partial probes": Adaptive(_planner(device), lambda b: 1e-6, gate=probes),  # plain but 1-request probes
            "adaptive-est": Adaptive(_planner(device), plain, estimator=est), "oracle": Oracle(GAMMA)}


def _queue(seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """16 prompts of 3-12 tokens (every other one repeating a stretch of itself) and 5-10 new tokens each."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(16):
        p = torch.randint(0, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
        prompts.append(torch.cat([p, p[:4]]) if i % 2 else p)
    return prompts, torch.randint(5, 11, (16,), generator=g)


def _generate_reference(target: TransformersCausalLM, prompts, counts, stop: list[int]) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time, stopping at `stop` (eos_token_id)."""
    out = []
    with torch.no_grad(), target.own_attention() as model:
        for p, n in zip(prompts, counts.tolist()):
            config = copy.deepcopy(model.generation_config)
            config.update(do_sample=False, max_new_tokens=n, eos_token_id=stop or None, pad_token_id=0,
                          temperature=None, top_p=None, top_k=None)
            x = p[None].to(model.device)
            gen = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
            out.append(gen[0, x.shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def cases(device) -> dict:
    """drafter name -> (decoder, prompts, counts, stop ids, reference)."""
    block_target, block_draft = tiny_models(gamma=GAMMA)
    target, draft_lm = target_and_draft_lm()
    out = {}
    for name, tgt, drafter in (("block", block_target, block_draft), ("ngram", target, NgramDrafter(1, 3)),
                               ("causal-lm", target, CausalLMDrafter(draft_lm))):
        prompts, counts = _queue(seed=3)
        free = _generate_reference(tgt, prompts, counts, [])
        stop = [free[0][3], free[5][4]]  # requests 0 and 5 stop early (others may too); a stop id can recur
        ref = _generate_reference(tgt, prompts, counts, stop)
        dec = SpecDecoder(tgt, drafter, config=EngineConfig(cache_tokens=2048, page_size=8, device=device))
        out[name] = (dec, prompts, counts, stop, ref)
    return out


@pytest.mark.parametrize("max_batch", sorted(QUEUE))
@pytest.mark.parametrize("name", ["block", "ngram", "causal-lm"])
def test_every_policy_and_mode_equals_transformers_generate(cases, name: str, max_batch: int, device) -> None:
    dec, prompts, counts, stop, ref = cases[name]
    n = QUEUE[max_batch]
    reasons = {"stop" if r[-1] in stop else "length" for r in ref[:n]}
    assert reasons == {"stop", "length"}, "the queue must hold requests ending both ways"
    accepted = rejected = 0
    for mode in VerifyMode:
        for pname, policy in _policies(device).items():
            out = dec.generate(prompts[:n], counts[:n], policy, mode=mode, max_batch=max_batch, stop_token_ids=stop)
            for i in range(n):
                got = out.tokens[i, : int(out.num_tokens[i])].tolist()
                assert got == ref[i], (name, mode.value, pname, i)
                assert not out.tokens[i, int(out.num_tokens[i]):].any()  # nothing past the end or the stop
                assert out.finish_reasons[i] == ("stop" if ref[i][-1] in stop else "length")
            spec = [s for s in out.steps if s.speculated]
            accepted += sum(int((s.correct_lens > 0).sum()) for s in spec)
            rejected += sum(int((s.correct_lens < s.caps - 1).sum()) for s in spec)
    assert accepted and (rejected or name == "block"), "drafts both accepted and rejected"  # block: a looping target


class Alternate(FixedK):
    """fixed-k that speculates every other step: the drafter catches up on the plain steps' tokens."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self._turn = 0

    def speculate(self, slots: torch.Tensor, generations: torch.Tensor) -> bool:
        self._turn += 1
        return self._turn % 2 == 0


def test_a_causal_lm_drafter_that_is_the_target_is_always_accepted(device) -> None:
    target, _ = target_and_draft_lm()
    twin = TransformersCausalLM(copy.deepcopy(target.hf_model))
    dec = SpecDecoder(target, CausalLMDrafter(twin), config=EngineConfig(cache_tokens=2048, page_size=8, device=device))
    prompts, _ = _queue(seed=4)
    ref = dec.generate(prompts[:8], 12, FixedK(0))
    for policy in (FixedK(GAMMA), Alternate(GAMMA)):
        out = dec.generate(prompts[:8], 12, policy, max_batch=3)  # 8 requests on 3 slots: refills
        assert torch.equal(out.tokens, ref.tokens)
        spec = [s for s in out.steps if s.speculated]
        assert len(spec) >= 6 and all(bool((s.correct_lens == GAMMA).all()) for s in spec)


@pytest.mark.parametrize("policy", [lambda: Alternate(GAMMA), lambda: PartialFixedK(GAMMA, every=3)])
@pytest.mark.parametrize("name", ["block", "causal-lm"])
def test_a_step_reports_the_tokens_its_drafter_caught_up(cases, name: str, policy, device) -> None:
    """catch_up = the tokens each drafting request committed since its last proposal beyond its root (its whole
    prompt after admission), walked here from the steps' owners and commit lengths: after plain steps, refills
    and steps where only some requests drafted (those whose confidence is not -inf)."""
    dec = cases[name][0]
    prompts, _ = _queue(seed=5)
    out = dec.generate(prompts[:7], 10, policy(), max_batch=3)
    lens, seen = {}, {}
    for s in out.steps:
        owners = s.owners.tolist()
        for q in owners:
            lens.setdefault(q, int(prompts[q].numel()))
            seen.setdefault(q, 0)
        if s.speculated:
            drafted = [q for q, c in zip(owners, s.confidence_logits[:, 0].tolist()) if c != -math.inf]
            assert s.drafting == len(drafted) and 0 < len(drafted) <= len(owners)
            assert s.catch_up == sum(lens[q] - seen[q] - 1 for q in drafted)
            seen.update({q: lens[q] for q in drafted})
        else:
            assert s.catch_up == 0 and s.drafting == 0
        for q, c in zip(owners, s.commit_lens.tolist()):
            lens[q] += c
    assert sum(s.catch_up for s in out.steps if s.speculated) > sum(p.numel() for p in prompts[:7]) - 7


@pytest.mark.parametrize("name", ["block", "ngram", "causal-lm"])
def test_one_and_two_token_prompts_equal_transformers_generate(cases, name: str, device) -> None:
    """The shortest prompts: a one-token prompt is its root alone (nothing to prefill), alone in the batch, beside
    a longer one, and refilled into a running batch."""
    dec = cases[name][0]
    g = torch.Generator().manual_seed(11)
    short = [torch.randint(0, VOCAB, (n,), generator=g) for n in (1, 2, 1, 5, 1, 2)]
    counts = torch.tensor([6, 9, 7, 8, 5, 6])
    ref = _generate_reference(dec.target, short, counts, [])
    for prompts, n, max_batch in ((short[:1], counts[:1], 1), (short, counts, 2), (short, counts, 6)):
        for policy in _policies(device).values():
            out = dec.generate(prompts, n, policy, max_batch=max_batch)
            assert [out.tokens[i, : int(n[i])].tolist() for i in range(len(prompts))] == ref[: len(prompts)], \
                (name, policy.name, max_batch)


def test_a_stop_inside_a_multi_token_commit_drops_the_rest(device) -> None:
    target, _ = target_and_draft_lm()
    dec = SpecDecoder(target, CausalLMDrafter(TransformersCausalLM(copy.deepcopy(target.hf_model))),
                      config=EngineConfig(cache_tokens=2048, page_size=8, device=device))
    prompts, _ = _queue(seed=4)
    free = dec.generate(prompts[:4], 16, FixedK(0)).tokens
    stop = int(free[0, 5])  # request 0's 6th token: inside its second commit of 4 (every draft is accepted)
    out = dec.generate(prompts[:4], 16, FixedK(GAMMA), stop_token_ids=[stop])
    first = int((free[0] == stop).nonzero()[0])
    assert first % (GAMMA + 1) != GAMMA  # the step committed tokens after the stop ...
    assert int(out.num_tokens[0]) == first + 1 and out.finish_reasons[0] == "stop"  # ... and they were dropped
    assert torch.equal(out.tokens[0, : first + 1], free[0, : first + 1]) and not out.tokens[0, first + 1:].any()


def test_a_drafter_of_another_vocabulary_or_tokenizer_is_refused(device) -> None:
    target, draft_lm = target_and_draft_lm()
    with pytest.raises(ValueError, match="the drafter's vocabulary has 32 tokens but the target's 64"):
        SpecDecoder(target, CausalLMDrafter(llama(1, vocab=32)), config=EngineConfig(cache_tokens=64))
    other = word_tokenizer()
    other.add_tokens(["extra"])
    with pytest.raises(ValueError, match="the drafter's tokenizer has 65 tokens but the target's 64"):
        SpecDecoder(target, CausalLMDrafter(draft_lm, tokenizer=other), config=EngineConfig(cache_tokens=64), tokenizer=word_tokenizer())
    swapped = word_tokenizer()
    swapped.eos_token = "w3"
    with pytest.raises(ValueError, match="eos_token_id is 2 for the target but 3 for the drafter"):
        SpecDecoder(target, CausalLMDrafter(draft_lm, tokenizer=swapped), config=EngineConfig(cache_tokens=64), tokenizer=word_tokenizer())
    SpecDecoder(target, CausalLMDrafter(draft_lm, tokenizer=word_tokenizer()), config=EngineConfig(cache_tokens=64),
                tokenizer=word_tokenizer())  # the same vocabulary: accepted
    with pytest.raises(ValueError, match="n_min must be <= n_max, got n_min=3 > n_max=2"):
        NgramDrafter(3, 2)
    with pytest.raises(ValueError, match="n_min must be an int >= 1, got 0"):
        NgramDrafter(0, 2)
    with pytest.raises(TypeError, match="draft must be a dspark.models.DraftModel or a Drafter"):
        SpecDecoder(target, "ngram", config=EngineConfig(cache_tokens=64))


@pytest.mark.cpu_only(reason="the demo command's n-gram family on the CPU (perf/device_check.sh runs the demo on a GPU)")
def test_the_demo_serves_the_ngram_family_beside_the_block_draft(tmp_path) -> None:
    from dspark.lab.demo.run import DemoConfig, parse_policies, run_demo

    assert parse_policies(["ngram-fixed", "ngram-adaptive-est"], 2) == ["fixed-0", "ngram-fixed-1", "ngram-fixed-2",
                                                                        "ngram-adaptive-est"]
    with pytest.raises(ValueError, match=r"policy 'ngram-fixed-0': k = 0 is outside \[1, gamma = 2\]"):
        parse_policies(["ngram-fixed-0"], 2)
    with pytest.raises(ValueError, match="unknown policy 'ngram-oracle'"):
        parse_policies(["ngram-oracle"], 2)
    target, draft = tiny_models(gamma=GAMMA)
    cfg = DemoConfig(out=str(tmp_path / "out"), batch_sizes=(2,), gamma=2, prompt_len=8, max_new_tokens=6, repeats=1,
                     profile_repeats=1, policies=("ngram-fixed-2", "ngram-adaptive-est"), tiers=())
    summary = run_demo(cfg, echo=lambda s: None, show_progress=False,
                       models=(target, draft, lambda text: [b % 64 for b in text.encode("utf-8")]))
    assert {r["policy"] for r in summary["results"]} == {"fixed-0", "ngram-fixed-2", "ngram-adaptive-est"}
    assert summary["lossless"]["checked_runs"] == 3 + 2 * 3  # every policy at B = 2, and in the two other modes
    family = summary["ngram"]["family"]
    assert [f["batch"] for f in family] == [2] and family[0]["best_fixed"].startswith("ngram-fixed-")
    assert "adaptive_est_vs_best_fixed" in family[0] and summary["ngram"]["estimator"]["steps_observed"] > 0
