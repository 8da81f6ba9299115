"""The NPU attention backend end to end on the CPU (the operator emulated): every policy and verify mode, with
graph tiers and ghost slots, commits exactly what dspark's default attention commits (greedy), on the tiny test
models and SmolLM2; tier steps through `NpuGraphBackend` (an emulated graph) replay what eager computes."""
from __future__ import annotations

import sys

import pytest
import torch

from dspark.ascend.attention import npu_attention
from dspark.ascend.emulator import EmulatedGraphBackend, FusedInferAttentionEmulator, emulated_torch_npu
from dspark.config import ScheduleConfig, VerifyMode
from dspark.cost import StepsPerSecondTable
from dspark.models.paged_attend import PagedAttend
from dspark.plan.planner import PlannerSettings, VerifyPlanner
from dspark.serve.attention import batch_attention
from dspark.serve.config import EngineConfig
from dspark.serve.drafters.causal_lm import CausalLMDrafter
from dspark.serve.drafters.ngram import NgramDrafter
from dspark.serve.engine import SpecDecoder
from dspark.serve.kv_cache import PagedKVCache
from dspark.serve.policies import Adaptive, FixedK, Oracle
from dspark.serve.policies.gate import GateSettings
from dspark.serve.tier_step import VerifyStep, VerifyStepShape, graph_slot_count
from tests.engine_models import VOCAB, tiny_models

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.cpu_only(reason="the NPU backend through the CPU emulator of its operator "
                                          "(perf/ascend_bringup.py --device npu runs the real one)")]

PAGE = 128          # the operator's page attention takes blocks of 128 .. 512
TIERS = (4, 8, 12)
GAMMA = 3


def _policies(tiers, max_batch):
    """Fixed-k, oracle and adaptive (its planner padding to the decoder's tiers and graph slots)."""
    planning = PlannerSettings(num_slots=8, tiers=tiers,
                               graph_slots=graph_slot_count(max_batch, tiers, GAMMA + 1) if tiers else None)
    planner = VerifyPlanner(ScheduleConfig(gamma=GAMMA), StepsPerSecondTable([1], [100.0], width=GAMMA + 1), planning)
    # no cost feedback: the two runs compared must decide alike whatever their measured step times
    gate = GateSettings(probe_every=2, cost_window=None)
    return [FixedK(GAMMA), Oracle(GAMMA), Adaptive(planner, lambda b: 0.004 * b, gate=gate)]


def _prompts(n: int, p: int, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, p), generator=torch.Generator().manual_seed(seed))


def _both(target, drafter, prompts, new, policy_fn, mode, tiers, max_batch=None):
    """(default attention's result, the NPU backend's result, operator calls) for the same run."""
    dec = SpecDecoder(target, drafter, config=EngineConfig(cache_tokens=8192, page_size=PAGE, tiers=tiers))
    want = dec.generate(prompts, new, policy_fn(), mode=mode, max_batch=max_batch)
    op = FusedInferAttentionEmulator(allow_float32=True)
    with npu_attention(target, op):
        got = dec.fork().generate(prompts, new, policy_fn(), mode=mode, max_batch=max_batch)
    return want, got, op.calls


@pytest.mark.parametrize("tiers", [None, TIERS], ids=["eager", "tiers"])
@pytest.mark.parametrize("mode", [m.value for m in VerifyMode])
@pytest.mark.parametrize("policy", range(3), ids=["fixed", "oracle", "adaptive"])
def test_tiny_models_commit_what_the_default_attention_commits(policy, mode, tiers) -> None:
    target, draft = tiny_models(gamma=GAMMA)
    want, got, calls = _both(target, draft, _prompts(5, 6), 10, lambda: _policies(tiers, 3)[policy], mode, tiers,
                               max_batch=3)
    assert torch.equal(got.tokens, want.tokens)
    assert [s.commit_lens.tolist() for s in got.steps] == [s.commit_lens.tolist() for s in want.steps]
    assert calls >= 2 * len(got.steps)          # every layer of every verify forward went through the operator
    if tiers is not None and mode == "compact" and policy == 1:    # oracle: ragged lengths, ghost padding rows
        assert any(s.layout.num_padding_rows > 0 for s in got.steps)
        assert any(s.layout.tier is not None for s in got.steps)


@pytest.mark.parametrize("mode", [m.value for m in VerifyMode])
def test_causal_lm_drafter_target_with_ghost_slots(mode) -> None:
    from tests.drafter_models import target_and_draft_lm

    target, draft_lm = target_and_draft_lm()
    prompts = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(3))
    want, got, _ = _both(target, CausalLMDrafter(draft_lm), prompts, 10, lambda: Oracle(GAMMA), mode, TIERS)
    assert torch.equal(got.tokens, want.tokens)


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    from dspark.models import load_smollm2

    try:
        return load_smollm2()
    except ImportError as exc:  # the model wheel is not installed
        pytest.skip(str(exc))


@pytest.mark.slow
def test_smollm2_commits_what_the_default_attention_commits(smollm2) -> None:
    """The real model (30 layers, GQA 9 / 3, head dim 64), compact verify padded to tiers with ghost slots (the
    mode the NPU backend exists for; the tiny models cover every policy and mode)."""
    target, tok = smollm2
    prompts = [tok(t, return_tensors="pt").input_ids[0] for t in
               ("The capital of France is Paris. The capital of France is", "1 2 3 4 5 6 7 8")]
    want, got, calls = _both(target, NgramDrafter(), prompts, 6, lambda: Oracle(3), "compact", (4, 8))
    assert torch.equal(got.tokens, want.tokens)
    assert calls >= 30 * len(got.steps)
    assert any(s.layout.num_padding_rows > 0 for s in got.steps)


def test_tier_steps_through_the_npu_graph_backend_replay_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """One tier captured through `NpuGraphBackend` (an emulated recording graph): successive layouts of the
    tier ([4, 4] then [1, 1] then [3, 1]) replay what the eager NPU backend and the default attention compute,
    and every replay re-issues each layer's operator in a task-update window first."""
    fake = emulated_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    target, _ = tiny_models(gamma=GAMMA)
    g = target.geometry
    cache = PagedKVCache(num_layers=g.num_layers, num_heads=g.num_kv_heads, head_dim=g.head_dim, num_pages=16,
                         page_size=PAGE)
    table = cache.admit(2, 64)
    for buf in (cache.k, cache.v):
        buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(0)))
    backend = EmulatedGraphBackend(warmup=0)
    with npu_attention(target, graph_backend=backend):
        step = VerifyStep(target, cache, VerifyStepShape((8,), width=4, max_requests=2), backend=backend)
    captured = list(fake.npu.log)
    assert captured.count("group_begin") == captured.count("group_end") == g.num_layers
    reference = batch_attention(cache, g, 16, 8)
    for lens, prefix in (([4, 4], [5, 9]), ([1, 1], [20, 3]), ([3, 1], [7, 30])):
        layout = step.runner.layout(torch.tensor(lens, dtype=torch.int32))
        tokens = torch.randint(0, VOCAB, (sum(lens),), generator=torch.Generator().manual_seed(sum(prefix)))
        k0, v0 = cache.k.clone(), cache.v.clone()
        fake.npu.log.clear()
        out = step(tokens, layout, torch.tensor(prefix), table)
        assert fake.npu.log.count("update_begin") == g.num_layers and fake.npu.log[-1] == "replay"
        cache.k.copy_(k0), cache.v.copy_(v0)
        eager = PagedAttend(reference, cache.k, cache.v, layout, torch.tensor(prefix), table)
        want = target.logits(target(torch.cat([tokens, tokens.new_zeros(layout.graph_num_tokens - sum(lens))]),
                                    eager.positions, eager))[: sum(lens)]
        torch.testing.assert_close(out.logits, want, rtol=1e-4, atol=1e-4)
    assert step.runner.replays[8] == 3
