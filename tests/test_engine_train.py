"""Draft training on the serving event: labels, training streams, the cache key (the head fit is tested
with the engine's test models in test_engine.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dspark.engine.model import ModelConfig, TinyLM
from dspark.engine.train import TrainConfig, stream_labels, training_streams

pytestmark = pytest.mark.usefixtures("one_thread")
CFG = ModelConfig(d_model=16, n_layers=1, n_heads=2, max_seq_len=40, vocab_size=8)


def test_stream_labels_are_greedy_conditional_acceptance() -> None:
    logits = torch.full((2, 4, 5), -1.0)
    argmax = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0]])
    logits.scatter_(-1, argmax.unsqueeze(-1), 1.0)
    truth = torch.tensor([[1, 0, 3, 4], [0, 0, 0, 1]])
    label, mask = stream_labels(logits, truth)
    assert label.tolist() == [[1, 0, 1, 1], [1, 1, 1, 0]]
    # head k is trained only where drafts < k all matched: up to and including the first miss
    assert mask.tolist() == [[True, True, False, False], [True, True, True, True]]


def test_training_streams_and_cache_key() -> None:
    cfg = TrainConfig(target=CFG, draft=CFG, gamma=3, head_streams=4, stream_prompt_len=6)
    torch.manual_seed(0)
    target = TinyLM(CFG).eval()
    data = torch.randint(0, 8, (500,), dtype=torch.uint8)
    streams = training_streams(cfg, target, data)
    assert streams.shape == (4, CFG.max_seq_len)
    starts = [bytes(data.tolist()).find(bytes(s[:6].tolist())) for s in streams.to(torch.uint8)]
    assert all(s >= 0 for s in starts)  # the prompts are corpus windows
    assert cfg.key() != replace(cfg, head_streams=5).key() != replace(cfg, stream_prompt_len=7).key()
    assert cfg.target_key() == replace(cfg, head_streams=5).target_key()
    with pytest.raises(ValueError, match="stream_prompt_len must be in"):
        training_streams(replace(cfg, stream_prompt_len=37), target, data)
