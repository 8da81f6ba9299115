"""Record the draft's confidence against the target's realised acceptance and fit STS temperatures.

Two recorders write the same STS rows (`StsRecorder` shards, read by `load_sts` / `fit_sts` /
`dspark calibrate`):

- `record_sts`: the decode loop itself, drafting gamma tokens and verifying all of them (static,
  fixed-gamma), so no position is censored by a cap. Any acceptance policy (greedy or sampling).
- `record_sts_teacher_forced` (greedy only): under greedy acceptance the committed tokens are the target's
  greedy stream whatever was accepted, so a step at committed length L sees exactly the stream's first L
  tokens. The recorder decodes the streams once (`dspark.models.streams`), runs the draft densely over
  them (its features: the target's hidden states on the stream) and takes, at each start L, the draft's
  block proposal, its confidence logits and the greedy prefix match against the stream. `starts="steps"` keeps only the decode loop's step boundaries (L = P, then
  L += accepted + 1: the very rows `record_sts` records, tests check it); `starts="all"` keeps every
  L in [P, P + max_new_tokens) (the `steps` field then holds L - P), ~tau times more engine rows for the
  same decoding work, which is what a per-position ECE of <= 1% needs.

The recording prompts are separate from the evaluation prompts. The fit (dspark.calibration.fit) holds out a
quarter of the requests and reports calibration metrics on them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from dspark.calibration.fit import Calibration, FitOptions, fit_sts
from dspark.calibration.recorder import StsData, StsOutcome, StsRecorder, load_sts
from dspark.config import VerifyMode
from dspark.models.draft import DraftModel
from dspark.models.streams import features, greedy_streams
from dspark.serve.config import GREEDY, SamplingParams
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import FixedK
from dspark.util.validate import check_int, check_type

STARTS = ("steps", "all")
RECORDERS = ("decode", "teacher_forced")


@dataclass(frozen=True)
class TeacherForcing:
    """How `record_sts_teacher_forced` records (the module note).

    Args:
        starts: `steps` (the decode loop's step boundaries) or `all` (every start L in [P, P + max_new_tokens)).
        batch: requests whose greedy streams are decoded at a time.
        rows: requests per draft block pass (its token logits are [rows, starts, gamma, V]).
    """

    starts: str = "steps"
    batch: int = 512
    rows: int = 64

    def __post_init__(self) -> None:
        if self.starts not in STARTS:
            raise ValueError(f"starts must be one of {STARTS}, got {self.starts!r}")
        check_int("batch", self.batch, 1)
        check_int("rows", self.rows, 1)


@dataclass(frozen=True)
class StsRecording:
    """How `record_and_fit` records its STS rows.

    Args:
        sampling: the acceptance the rows record (greedy at temperature 0); its seed also seeds the fit's bootstrap.
        recorder: `decode` (`record_sts`: the decode loop, any acceptance) or `teacher_forced`
            (`record_sts_teacher_forced`: greedy only).
    """

    sampling: SamplingParams = GREEDY
    recorder: str = "decode"

    def __post_init__(self) -> None:
        check_type("sampling", self.sampling, SamplingParams)
        if self.recorder not in RECORDERS:
            raise ValueError(f"recorder must be one of {RECORDERS}, got {self.recorder!r}")
        if self.recorder == "teacher_forced" and not self.sampling.greedy:
            raise ValueError("recorder='teacher_forced' records greedy acceptance only; use recorder='decode' "
                             "for sampling")


def record_sts(decoder: SpecDecoder, prompts: Tensor, gamma: int, max_new_tokens: int, shard_dir: Path, *,
               sampling: SamplingParams = GREEDY) -> StsData:
    """Decode `prompts` with fixed-gamma static verify under `sampling` and record every step (with the draft
    logits, for the top-2 margin baseline) as STS shards under `shard_dir`; returns the loaded rows."""
    policy = "greedy" if sampling.greedy else "sampling"
    res = decoder.fork(keep_draft_logits=True).generate(prompts, max_new_tokens, FixedK(gamma), sampling,
                                                        mode=VerifyMode.STATIC)
    with StsRecorder(shard_dir, gamma=gamma) as rec:
        for step, s in enumerate(res.steps):
            rec.record(s.confidence_logits.cpu(), verify_lens=s.caps.cpu(), request_ids=s.requests,
                       outcome=StsOutcome(correct_lens=s.correct_lens.cpu(), policy=policy),
                       draft_logits=s.draft_logits.cpu(), step=step)
    return load_sts([shard_dir])


@torch.no_grad()
def block_outcomes(draft: DraftModel, streams: Tensor, hidden: Tensor, prompt_len: int, gamma: int,
                   max_new_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    """For every start L = P + i (i < max_new_tokens) of every stream [N, >= P + max_new_tokens + gamma - 1]
    with the target's hidden states on it [N, >= P + max_new_tokens - 2, d] (`greedy_streams`): the draft's
    confidence logits [N, n, gamma], its token logits [N, n, gamma, V] and the greedy accepted-draft count
    [N, n] (prefix match of the block's argmax drafts against stream[L:L+gamma])."""
    p, n, g = prompt_len, max_new_tokens, gamma
    if streams.shape[1] < p + n + g - 1:
        raise ValueError(f"streams of length {streams.shape[1]} are too short for prompt {p} + max_new_tokens {n} "
                         f"+ gamma {g} - 1")
    feats = features(hidden[:, : p + n - 2].to(streams.device))
    roots = draft.forward_dense(streams[:, : p + n - 1], feats)[:, p - 1:]  # the root's hidden state at L - 1
    b, n_starts = roots.shape[:2]
    anchor = streams[:, p - 1: p + n - 1]                                   # the root: stream[L - 1]
    logits, conf = draft.propose(roots.flatten(0, 1), g, anchor.flatten())
    logits, conf = logits.unflatten(0, (b, n_starts)), conf.unflatten(0, (b, n_starts))
    truth = streams[:, p: p + n + g - 1].unfold(1, g, 1)                   # [N, n, g]: stream[L + j]
    accepted = torch.cumprod((logits.argmax(-1) == truth).to(torch.int64), dim=-1).sum(-1)
    return conf, logits, accepted


def _step_starts(accepted: Tensor) -> list[tuple[Tensor, Tensor]]:
    """The decode loop's step boundaries from the accepted counts [N, n]: per step, (requests, offsets)."""
    n = accepted.shape[1]
    offset = torch.zeros(accepted.shape[0], dtype=torch.int64, device=accepted.device)
    out = []
    while True:
        live = (offset < n).nonzero().squeeze(1)
        if not live.numel():
            return out
        out.append((live, offset[live]))
        offset[live] += accepted[live, offset[live]] + 1


def record_sts_teacher_forced(decoder: SpecDecoder, prompts: Tensor, gamma: int, max_new_tokens: int,
                              shard_dir: Path, *, forcing: TeacherForcing = TeacherForcing()) -> StsData:
    """Greedy STS rows of the engine's draft and target without the decode loop (see the module note).

    Args:
        prompts: [N, P] recording prompts; gamma: the draft positions recorded (<= the draft's block);
        max_new_tokens: the greedy stream recorded per request; shard_dir: where the STS shards are written.
        forcing: the starts recorded and the batching of the streams and the block pass (`TeacherForcing`).

    Returns:
        The loaded rows.
    """
    check_type("forcing", forcing, TeacherForcing)
    starts, batch, rows = forcing.starts, forcing.batch, forcing.rows
    draft, p = decoder.draft, prompts.shape[1]
    if not 1 <= gamma <= draft.gamma:
        raise ValueError(f"gamma must be in [1, {draft.gamma}] (the draft's block), got {gamma!r}")
    full = torch.full((1,), gamma + 1, dtype=torch.int32)
    with StsRecorder(shard_dir, gamma=gamma) as rec:
        for first in range(0, prompts.shape[0], batch):
            with decoder.target.own_attention() as model:
                streams, hidden = greedy_streams(model, prompts[first: first + batch].to(decoder.device),
                                                 max_new_tokens + gamma - 1, batch=batch)
            for sub in range(0, streams.shape[0], rows):
                conf, logits, accepted = block_outcomes(draft, streams[sub: sub + rows], hidden[sub: sub + rows], p,
                                                        gamma, max_new_tokens)
                steps = _step_starts(accepted) if starts == "steps" else [
                    (torch.arange(accepted.shape[0], device=accepted.device), torch.full_like(accepted[:, 0], i))
                    for i in range(max_new_tokens)]
                for step, (reqs, off) in enumerate(steps):
                    rec.record(conf[reqs, off].cpu(), verify_lens=full.expand(reqs.numel()),
                               request_ids=reqs.cpu() + first + sub,
                               outcome=StsOutcome(correct_lens=accepted[reqs, off].cpu()),
                               draft_logits=logits[reqs, off].cpu(), step=step)
    return load_sts([shard_dir])


def record_and_fit(decoder: SpecDecoder, prompts: Tensor, gamma: int, max_new_tokens: int, shard_dir: Path, *,
                   recording: StsRecording = StsRecording(), bootstrap: int = 50) -> Calibration:
    """Record (`record_sts`, or with recording.recorder="teacher_forced" `record_sts_teacher_forced`, greedy only)
    and fit the per-position temperatures (NLL) with a held-out report, its bootstrap seeded with
    `recording.sampling.seed`."""
    check_type("recording", recording, StsRecording)
    sampling = recording.sampling
    if recording.recorder == "teacher_forced":
        data = record_sts_teacher_forced(decoder, prompts, gamma, max_new_tokens, shard_dir)
    else:
        data = record_sts(decoder, prompts, gamma, max_new_tokens, shard_dir, sampling=sampling)
    return fit_sts(data, FitOptions(method="nll", bootstrap=bootstrap, seed=sampling.seed),
                   policy="greedy" if sampling.greedy else "sampling")
