"""The runtime stays shallow: from `dspark.generate` to the target model's forward on a compact tier step, at most
8 dspark frames (nano-vllm: 6), counted on the real call stack of a run."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import dspark
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve.generate import generate
from dspark.verify.graphs import TierGraphRunner
from tests.drafter_models import target_and_draft_lm, word_tokenizer

ROOT = Path(dspark.__file__).parent


def _dspark_frames(frame) -> list[str]:
    """The dspark frames from `frame` back to `dspark.generate` (inclusive), innermost first."""
    names = []
    while frame is not None:
        if Path(frame.f_code.co_filename).is_relative_to(ROOT):
            names.append(f"{Path(frame.f_code.co_filename).relative_to(ROOT)}:{frame.f_code.co_qualname}")
            if frame.f_code is generate.__code__:
                return names
        frame = frame.f_back
    return []


@pytest.mark.cpu_only(reason="the frames of the eager tier path; a GPU replays the captured graph instead")
def test_generate_reaches_the_model_forward_in_at_most_8_frames(monkeypatch) -> None:
    target, _ = target_and_draft_lm()
    forward = TransformersCausalLM.forward
    stacks: list[list[str]] = []

    def spy(self, *args, **kwargs):  # stands in for the model's forward frame
        frame = sys._getframe()
        codes = set()
        f = frame
        while f is not None:
            codes.add(f.f_code)
            f = f.f_back
        if TierGraphRunner.run.__code__ in codes:  # a compact step replaying its tier
            stacks.append(_dspark_frames(frame))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(TransformersCausalLM, "forward", spy)
    out = dspark.generate(["w53 w4 w25 w59 w35", "w30 w31 w7"], target=target, tokenizer=word_tokenizer(), k=3,
                          max_new_tokens=8)
    assert any(s.speculated for s in out.result.steps)
    assert stacks and all(stacks), "no tier step reached the model from dspark.generate"
    deepest = max(stacks, key=len)  # + the model's own forward, which the spy stands in for
    assert len(deepest) + 1 <= 8, "\n".join([*reversed(deepest), "models/transformers_lm.py:forward"])
