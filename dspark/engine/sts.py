"""Record the draft's confidence against the target's realised acceptance and fit STS temperatures.

The recording run drafts gamma tokens and verifies all of them (static, fixed-gamma), so no position is
censored by a cap; its prompts are separate from the evaluation prompts. The fit (dspark.calibration)
holds out a quarter of the requests and reports calibration metrics on them.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from dspark.calibration import Calibration, fit_sts
from dspark.calibration_recorder import StsData, StsRecorder, load_sts
from dspark.config import VerifyMode
from dspark.engine.decode import SpecDecoder
from dspark.engine.policies import FixedK


def record_sts(decoder: SpecDecoder, prompts: Tensor, gamma: int, max_new_tokens: int, shard_dir: Path, *,
               sampling: bool = False, temperature: float = 1.0, seed: int = 0) -> StsData:
    """Decode `prompts` with fixed-gamma static verify and record every step (with the draft logits, for the
    top-2 margin baseline) as STS shards under `shard_dir`; returns the loaded rows."""
    policy = "sampling" if sampling else "greedy"
    res = decoder.generate(prompts, max_new_tokens, FixedK(gamma), mode=VerifyMode.STATIC, sampling=sampling,
                           temperature=temperature, seed=seed)
    with StsRecorder(shard_dir, gamma=gamma) as rec:
        for step, s in enumerate(res.steps):
            rec.record(s.confidence_logits.cpu(), verify_lens=s.caps.cpu(), request_ids=s.requests,
                       correct_len=s.correct_len.cpu(), draft_logits=s.draft_logits.cpu(), policy=policy,
                       step=step)
    return load_sts([shard_dir])


def record_and_fit(decoder: SpecDecoder, prompts: Tensor, gamma: int, max_new_tokens: int, shard_dir: Path, *,
                   sampling: bool = False, temperature: float = 1.0, seed: int = 0,
                   bootstrap: int = 50) -> Calibration:
    """Record (`record_sts`) and fit the per-position temperatures (NLL) with a held-out report."""
    data = record_sts(decoder, prompts, gamma, max_new_tokens, shard_dir, sampling=sampling,
                      temperature=temperature, seed=seed)
    return fit_sts(data, policy="sampling" if sampling else "greedy", method="nll", bootstrap=bootstrap, seed=seed)
