"""The verify step's model forward under `compile_model=True` (torch.compile of the dense layers, attention
left to its planned kernel) equals the eager step, tier by tier; the default compiles on CUDA only; one
compile serves every tier, step and layer."""
from __future__ import annotations

import pytest
import torch
from engine_models import tiny_llama

from dspark.lab.sweep import SweepCache, VerifyStepAdapter
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve import tier_step as verify_step


def adapter(device, compile_model):
    target = TransformersCausalLM(tiny_llama())
    return VerifyStepAdapter(target, verify_step.VerifyStepShape((8, 24), width=6, max_requests=4),
                             SweepCache(context=20, seed=3), device=device, compile_model=compile_model)


def test_compiled_verify_step_equals_eager(device):
    eager, compiled = adapter(device, False), adapter(device, True)
    assert compiled.verify.compile_model and not eager.verify.compile_model
    for b, rows in ((4, 22), (2, 7), (3, 13)):  # tiers 24, 8 and 24 again
        outs = []
        for a in (eager, compiled):
            a.prepare(b, rows)
            outs.append(a.verify(*a._step))
        (h0, l0, p0), (h1, l1, p1) = outs
        assert h0.shape == (rows, h0.shape[1]) and torch.equal(p0, p1)
        torch.testing.assert_close(h1, h0, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-4)
        assert torch.equal(l1.argmax(-1), l0.argmax(-1))


def test_compile_default_is_cuda_only(device):
    assert adapter(device, None).verify.compile_model == (device.type == "cuda")


def test_compile_model_must_be_a_bool(device):
    with pytest.raises(TypeError, match="compile_model must be a bool or None, got 1"):
        adapter(device, 1)


def test_one_compile_serves_every_tier_step_and_layer(device, monkeypatch):
    """Graphs compiled (a counting backend) for a 3-tier step: no more for eager steps past the largest
    tier, for a second step of other tiers and width, nor for a model of twice the layers (before: one
    graph set per tier, and the layer index guarded per layer: 36 graphs for 3 tiers of 2 layers)."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(verify_step, "COMPILE_BACKEND", counting)
    counts = []
    for layers in (2, 4):
        torch._dynamo.reset()
        graphs.clear()
        hf = tiny_llama()
        if layers != hf.config.num_hidden_layers:
            from transformers import AutoModelForCausalLM
            hf.config.num_hidden_layers = layers
            hf = AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32).eval()
        target = TransformersCausalLM(hf)
        first = VerifyStepAdapter(target, verify_step.VerifyStepShape((8, 16, 24), width=6, max_requests=6),
                                  SweepCache(context=20, seed=3), device=device, compile_model=True)
        for b, rows in ((4, 22), (2, 7), (3, 14)):  # tiers 24, 8, 16: compiled at the first forwards
            first.prepare(b, rows)
            first.step()
        counts.append(len(graphs))
        for b, rows in ((6, 31), (5, 27)):  # eager past the largest tier
            first.prepare(b, rows)
            first.step()
        second = VerifyStepAdapter(target, verify_step.VerifyStepShape((4, 12, 20), width=5, max_requests=4),
                                   SweepCache(context=20, seed=3), device=device, compile_model=True)
        for b, rows in ((2, 4), (3, 11), (4, 18)):  # its tiers 4, 12, 20
            second.prepare(b, rows)
            second.step()
        assert len(graphs) == counts[-1], f"{layers} layers: {counts[-1]} graphs, then {len(graphs)}"
        assert first.runner.eager_steps == 2
    assert counts[0] == counts[1] < 36, counts
