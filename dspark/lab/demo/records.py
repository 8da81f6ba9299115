"""Turn a decode run's step outcomes into telemetry records (read back once, after the run)."""
from __future__ import annotations

from typing import Sequence

import torch

from dspark.config import ScheduleConfig
from dspark.plan.budget import expected_commit
from dspark.plan.survival import calibrated_survival
from dspark.serve.outcome import GenerateResult
from dspark.telemetry import StepRecord


def step_records(result: GenerateResult, *, policy: str, mode: str, sampling: bool, lag: int,
                 temperatures: Sequence[float] | torch.Tensor | None = None) -> list[StepRecord]:
    """One StepRecord per step; predicted tau from the calibrated survival of the verified drafts.

    temperatures: STS temperatures for positions 0..gamma-1; a policy drafting k tokens uses the first k.
    """
    out = []
    for s in result.steps:
        caps = s.caps.detach().cpu().to(torch.int64)
        commit = s.commit_lens.detach().cpu().to(torch.int64)
        b, k = s.confidence_logits.shape
        if k:
            temps = None if temperatures is None else torch.as_tensor(temperatures)[:k]
            survival = calibrated_survival(s.confidence_logits.detach().cpu(), temps)
            predicted = float(expected_commit(survival, caps, ScheduleConfig(gamma=k)))
        else:
            predicted = float(b)
        out.append(StepRecord(
            policy=policy, mode=mode, sampling=sampling, batch=b, lag=lag, tier=s.layout.tier,
            budget=s.plan.budget, verify_lens=caps.tolist(), rows=s.layout.graph_num_tokens,
            predicted_tau=predicted, committed=int(commit.sum()), proposed=int((caps - 1).sum()),
            accepted=int((commit - 1).sum()), t_draft=s.times.draft, t_plan=s.times.plan,
            t_verify=s.times.verify, t_accept=s.times.accept, host_syncs=s.host_syncs, speculated=k > 0,
            t_prefill=s.times.prefill, useful=s.useful, folded_prefill=s.prefill_tokens if s.prefill_folded else 0,
            busy_slots=s.busy_slots, drafted=k,
        ))
    return out
