"""Checks once, at the edge: a decode step validates each of its inputs once, and the per-layer attention
path validates nothing.

Every validator of the package (module-level functions and methods named `check*` / `_check*`, the
attention's `_host_ints`, `int_tensor`) is wrapped with a counter while one `generate` runs; counts are kept
per speculative step, keyed by (validator, the argument name it was given). A validator called inside
another counts once (the outer one). A forward's attention plan (`RaggedVerifyAttention.plan`, and the
cache check of the `PagedAttend` that plans it) is that forward's public edge, as FlashInfer's plan is: its
checks may run once per forward, the others once per step. Nothing may run inside a layer's attention call.
"""
from __future__ import annotations

import collections
import functools
import inspect
import re
import sys

import pytest
import torch

import dspark.serve.step as step_module
from dspark.config import ScheduleConfig
from dspark.cost import StepsPerSecondTable
from dspark.models import paged_attend
from dspark.plan.planner import PlannerSettings, VerifyPlanner
from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import Adaptive, FixedK, Policy, PolicyPlan
from dspark.serve.policies.gate import GateSettings
from dspark.verify.attention import RaggedVerifyAttention
from tests.serve.test_engine import _prompts

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cpu_only(
    reason="counts Python-level validator calls; the device only changes where tensors live")]

GAMMA = 4
VALIDATOR = re.compile(r"^_?(check|host_ints$|int_tensor$)")
FORWARD_EDGE = {"RaggedVerifyAttention.plan", "RaggedVerifyAttention.check_cache"}


class Counts:
    """Validator calls per speculative step; which of them ran inside a forward's plan or a layer call."""

    def __init__(self) -> None:
        self.steps: list[collections.Counter] = []
        self.forwards: list[int] = []
        self.in_layer: list[str] = []
        self.depth = self.layer = 0
        self.step: collections.Counter | None = None

    def wrap(self, fn, name: str):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self.step is not None and self.depth == 0:
                label = next((a for a in args if isinstance(a, str)), "")
                self.step[(name, label)] += 1
                if self.layer:
                    self.in_layer.append(name)
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
        return counted


@pytest.fixture
def counts(monkeypatch) -> Counts:
    c = Counts()
    seen: set[int] = set()
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("dspark") or mod is None:
            continue
        for attr, obj in list(vars(mod).items()):
            if inspect.isfunction(obj) and VALIDATOR.match(attr) and obj.__module__.startswith("dspark"):
                monkeypatch.setattr(mod, attr, c.wrap(obj, f"{obj.__module__}.{attr}"))
            elif inspect.isclass(obj) and obj.__module__ == mod_name and id(obj) not in seen:
                seen.add(id(obj))
                for a, f in list(vars(obj).items()):
                    if inspect.isfunction(f) and VALIDATOR.match(a):
                        monkeypatch.setattr(obj, a, c.wrap(f, f"{obj.__qualname__}.{a}"))
    monkeypatch.setattr(RaggedVerifyAttention, "plan",
                        c.wrap(RaggedVerifyAttention.plan, "RaggedVerifyAttention.plan"))
    layer_call = paged_attend.PlannedAttend.__call__

    def in_layer(self, *args, **kwargs):
        c.layer += 1
        try:
            return layer_call(self, *args, **kwargs)
        finally:
            c.layer -= 1
    monkeypatch.setattr(paged_attend.PlannedAttend, "__call__", in_layer)
    speculative_step = step_module.speculative_step

    def step(*args, **kwargs):
        c.step = collections.Counter()
        try:
            return speculative_step(*args, **kwargs)
        finally:
            c.steps.append(c.step)
            c.forwards.append(c.step[("RaggedVerifyAttention.plan", "")])
            c.step = None
    monkeypatch.setattr(step_module, "speculative_step", step)
    return c


@pytest.fixture(scope="module")
def models():
    from tests.engine_models import tiny_models

    return tiny_models(gamma=GAMMA)


def _adaptive(decoder: SpecDecoder, b: int) -> Adaptive:
    planner = VerifyPlanner(ScheduleConfig(gamma=GAMMA), StepsPerSecondTable([1], [200.0], width=GAMMA + 1),
                            PlannerSettings(lag=1, num_slots=8, tiers=decoder.tiers or None,
                                            graph_slots=decoder.graph_slots(b, GAMMA + 1)))
    return Adaptive(planner, lambda b: 0.004 * b, gate=GateSettings(probe_every=2))


@pytest.mark.parametrize("tiers", [None, (8, 16, 24)], ids=["eager", "tiers"])
@pytest.mark.parametrize("mode", ["compact", "static"])
@pytest.mark.parametrize("policy", ["adaptive", "fixed-3"])
def test_each_step_validates_each_input_once_and_no_layer_validates(models, counts, tiers, mode, policy):
    decoder = SpecDecoder(*models, config=EngineConfig(cache_tokens=2048, page_size=8, tiers=tiers))
    pol = _adaptive(decoder, 4) if policy == "adaptive" else FixedK(3)
    decoder.generate(_prompts(4, 6), 10, pol, mode=mode)
    assert len(counts.steps) >= 2, "the run must take speculative steps for the count to mean anything"
    assert not counts.in_layer, f"validators ran inside per-layer attention calls: {counts.in_layer[:5]}"
    for i, (step, forwards) in enumerate(zip(counts.steps, counts.forwards)):
        assert forwards >= 1, f"step {i} planned no attention forward"
        per_forward = {k: v for k, v in step.items() if k[0] in FORWARD_EDGE and v > forwards}
        per_step = {k: v for k, v in step.items() if k[0] not in FORWARD_EDGE and v > 1}
        assert not per_forward, f"step {i} ({forwards} forwards): attention checks ran more than once per forward"
        assert not per_step, f"step {i}: inputs validated more than once in one step: {per_step}"


class BadLens(Policy):
    """A user policy whose verify lengths exceed W: caught at the step's edge, naming the value."""

    num_drafts = GAMMA

    def plan(self, confidence_logits, slots, generations, prepass=None) -> PolicyPlan:
        return PolicyPlan(torch.full((slots.numel(),), GAMMA + 2, dtype=torch.int32))


@pytest.mark.parametrize("mode", ["compact", "cap-accept"])
def test_a_policys_bad_verify_lens_raise_naming_the_value(models, mode):
    decoder = SpecDecoder(*models, config=EngineConfig(cache_tokens=2048, page_size=8))
    with pytest.raises(ValueError, match=rf"verify_lens\[0\] = {GAMMA + 2} is outside \[1, W={GAMMA + 1}\]"):
        decoder.generate(_prompts(2, 6), 4, BadLens(), mode=mode)
