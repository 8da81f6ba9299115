"""Fitting and measuring the draft's `dspark.ConfidenceHead` on recorded greedy streams (the head stage of
`dspark.models.train_draft`): rows at every serving start (the head's inputs: chain state and the features of
its distribution), the seeded re-initialisation, the L-BFGS fit on the greedy conditional-acceptance event, and
the per-position reports a manifest records.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from dspark.calibration.confidence import confidence_loss, previous_tokens
from dspark.models.draft import DraftModel
from dspark.models.draft_file import round_to_file
from dspark.models.stream_store import Streams
from dspark.models.streams import features, stream_labels
from dspark.util.validate import check_int, check_real

Rows = tuple[Tensor, Tensor, Tensor, Tensor]  # head inputs [R, g, H], previous tokens, labels, masks [R, g]

HEAD_L2 = 3e-2  # see fit_confidence


@torch.no_grad()
def stream_rows(draft: DraftModel, tokens: Tensor, hidden: Tensor, prompt_len: int, chunk: int = 16
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """At every serving start whose gamma tokens are all in the stream: the head's inputs [R, g, d + F]
    (`DraftModel.head_inputs`: the greedy chain's states and their distributions' features), the token before
    each draft [R, g], and greedy conditional labels / masks [R, g].

    tokens [N, T] and hidden [N, T - 1, d] (any float dtype, any device) are greedy streams of prompt_len-token
    prompts; the rows are on the draft's device."""
    g, p, t, device = draft.gamma, prompt_len, tokens.shape[1], draft.vocab_ids.device
    out: list[list[Tensor]] = [[], [], [], []]
    to_draft = torch.full((draft.cfg.vocab_size,), -1, dtype=torch.int64, device=device)
    to_draft[draft.vocab_ids] = torch.arange(draft.vocab_ids.numel(), device=device)
    for tok, hid in zip(tokens.split(chunk), hidden.split(chunk)):
        tok, hid = tok.to(device), hid.to(device)
        x = draft.forward_dense(tok, features(hid.float()))[:, p - 1: t - g]
        hk, reduced = draft.chain(x, g)
        inputs = draft.head_inputs(hk, reduced)
        label, reached = stream_labels(reduced, to_draft[tok[:, p:].unfold(1, g, 1)])
        drafts = draft.vocab_ids[reduced.argmax(-1)]
        for acc, v in zip(out, (inputs, previous_tokens(tok[:, p - 1: t - g].flatten(), drafts.flatten(0, 1)),
                                label, reached)):
            acc.append(v.flatten(0, 1) if v.dim() > 2 else v)
    return tuple(torch.cat(v) for v in out)  # type: ignore[return-value]


def reset_head(draft: DraftModel, seed: int) -> None:
    """Re-initialise the ConfidenceHead from `seed` alone: projection uniform in +-1/sqrt(fan_in) (nn.Linear's
    range; a zero projection with the zero embedding would be a stationary point of their product), zero
    bias, zero previous-token embedding (a token absent from the fit rows adds nothing) and zero per-position
    terms."""
    head = draft.confidence
    gen = torch.Generator().manual_seed(seed)
    bound = head.proj.in_features ** -0.5
    with torch.no_grad():
        head.proj.weight.copy_((torch.rand(head.proj.weight.shape, generator=gen) * 2 - 1) * bound)
        head.proj.bias.zero_()
        if head.embed is not None:
            head.embed.weight.zero_()
        if head.positions:
            head.position_bias.zero_()
            head.position_weight.zero_()


def fit_confidence(draft: DraftModel, rows: tuple[Tensor, Tensor, Tensor, Tensor], max_iter: int,
                   l2: float = 0.0) -> float:
    """Fit the ConfidenceHead alone (full batch L-BFGS, from its current weights) on the greedy
    conditional-acceptance rows; returns the final loss (without the penalty).

    `l2` x the squared norm of its weights (the shared Linear, the previous-token embedding and the
    per-position feature weights; not the biases) keeps it from memorising the fit streams. 0.03 was chosen
    for the seed's head by 2-fold cross-validation over the calibration split's files; a stronger penalty on
    the shared part only (3, per-position weights free) ranks as well as the online estimator but sits below
    the held-out level by more than a temperature can move (perf/README.md, "engine_calibration.py").
    """
    hidden, prevs, labels, masks = rows
    prevs = prevs if draft.confidence.markov_rank else None
    head = draft.confidence
    weights = [w for name, w in head.named_parameters() if name.endswith("weight")]
    opt = torch.optim.LBFGS(head.parameters(), max_iter=max_iter, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=50, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad(set_to_none=True)
        loss = confidence_loss(head(hidden, prevs), labels, masks, math.inf)
        if l2:
            loss = loss + l2 * sum(w.pow(2).sum() for w in weights)
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return float(confidence_loss(head(hidden, prevs), labels, masks, math.inf))


def acceptance(labels: Tensor, masks: Tensor) -> dict:
    """Per draft position: reached (drafts before it all matched), accepted, their ratio; the mean accepted
    drafts per start with all gamma drafts verified, and with only the first k verified for k = 1..gamma."""
    run = (labels.bool() & masks).sum(1)
    reached, accepted = masks.sum(0), (labels.bool() & masks).sum(0)
    return {"starts": int(labels.shape[0]), "reached": reached.tolist(), "accepted": accepted.tolist(),
            "rate": [round(a / max(r, 1), 4) for a, r in zip(accepted.tolist(), reached.tolist())],
            "mean_accepted": round(float(run.float().mean()), 4),
            "mean_accepted_by_gamma": [round(float(run.clamp(max=k).float().mean()), 4)
                                       for k in range(1, labels.shape[1] + 1)]}


def head_report(draft: DraftModel, rows: tuple[Tensor, Tensor, Tensor, Tensor]) -> dict:
    """The head on some rows: BCE (all positions equally weighted) and, per position, the mean predicted
    conditional acceptance next to the realised rate (an offset a temperature cannot remove)."""
    hidden, prevs, labels, masks = rows
    with torch.no_grad():
        logits = draft.confidence(hidden, prevs if draft.confidence.markov_rank else None)
        loss = float(confidence_loss(logits, labels, masks, math.inf))
    m = masks.bool()
    n = m.sum(0).clamp_min(1)
    mean_p = (torch.sigmoid(logits.float()) * m).sum(0) / n
    rate = (labels.bool() & m).sum(0) / n
    return {"loss": round(loss, 5), "mean_p": [round(float(v), 4) for v in mean_p],
            "rate": [round(float(v), 4) for v in rate]}


def _cat(parts: list[Rows]) -> Rows:
    return tuple(torch.cat([p[i] for p in parts]) for i in range(4))  # type: ignore[return-value]


@dataclass(frozen=True)
class HeadFitConfig:
    """The head stage's fit, checked when built: `reset_head`'s `seed`, `fit_confidence`'s L-BFGS `iters` and `l2`
    weight."""

    seed: int
    iters: int
    l2: float = HEAD_L2

    def __post_init__(self) -> None:
        check_int("seed", self.seed, 0)
        check_int("iters", self.iters, 1)
        check_real("l2", self.l2, 0, math.inf, high_open=True)


def head_stage(draft: DraftModel, head: dict[str, Streams], held: dict[str, Streams], config: HeadFitConfig, *,
               log: Callable[[str], None], split: str = "calibration") -> tuple[dict, dict]:
    """Reset the head (`config.seed`), fit it on the rows of every kind's `head` streams, then measure on `held`.

    Args:
        draft: the trained draft (its head is refitted in place).
        head, held: {kind: greedy Streams} of the fit split and of the held-out split.
        config: the reset's seed, the L-BFGS iterations and L2 weight.
        log: progress lines.
        split: the fit split's name, recorded.
    Returns:
        (manifest entries: held-out acceptance (code) and per kind, head losses and reports; wall seconds).
    """
    wall, t0, l2 = {}, time.perf_counter(), config.l2
    reset_head(draft, config.seed)
    fit_rows = _cat([stream_rows(draft, s.tokens, s.hidden, s.prompt_len) for s in head.values()])
    fit_confidence(draft, fit_rows, config.iters, l2)
    round_to_file(draft)
    fit = head_report(draft, fit_rows)
    wall["confidence_head"] = time.perf_counter() - t0
    log(f"confidence head fitted on {sum(s.tokens.shape[0] for s in head.values())} {split} streams "
        f"({', '.join(head)}): loss {fit['loss']:.4f}")
    t0 = time.perf_counter()
    rows = {k: stream_rows(draft, s.tokens, s.hidden, s.prompt_len) for k, s in held.items()}
    acc = {k: acceptance(r[2], r[3]) for k, r in rows.items()}
    reports = {k: head_report(draft, r) for k, r in rows.items()}
    pooled = head_report(draft, _cat(list(rows.values())))
    wall["heldout_eval"] = time.perf_counter() - t0
    for k, a in acc.items():
        log(f"held-out {k}: conditional acceptance per position {a['rate']} (reached {a['reached']}); mean "
            f"accepted drafts {a['mean_accepted_by_gamma']} at gamma 1..{len(a['rate'])}; head loss "
            f"{reports[k]['loss']:.4f}, mean p {reports[k]['mean_p']}")
    return {"heldout_acceptance": acc["code"], "heldout_acceptance_per_kind": acc,
            "confidence_loss": {"fit": fit["loss"], "heldout": pooled["loss"]},
            "confidence_head": {"split": split, "streams": {k: s.tokens.shape[0] for k, s in head.items()},
                                "l2": l2, "features": draft.cfg.confidence_features, "fit": fit,
                                "heldout": pooled, "heldout_per_kind": reports}}, wall
