"""Fitting and measuring the draft's `dspark.ConfidenceHead` on recorded greedy streams (the head stage of
`dspark.models.train_draft`): rows at every serving start, the seeded re-initialisation, the L-BFGS fit on
the greedy conditional-acceptance event, and the per-position reports a manifest records.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from dspark.calibration.confidence import confidence_loss, previous_tokens
from dspark.models.draft import DraftModel
from dspark.models.streams import features, stream_labels

HEAD_L2 = 3e-2  # see fit_confidence


@torch.no_grad()
def stream_rows(draft: DraftModel, tokens: Tensor, hidden: Tensor, prompt_len: int, chunk: int = 16
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """At every serving start whose gamma tokens are all in the stream: the greedy chain's states
    [R, g, d], the token before each draft [R, g], and greedy conditional labels / masks [R, g]."""
    g, p, t = draft.gamma, prompt_len, tokens.shape[1]
    out: list[list[Tensor]] = [[], [], [], []]
    to_draft = torch.full((draft.cfg.vocab_size,), -1, dtype=torch.int64)
    to_draft[draft.vocab_ids] = torch.arange(draft.vocab_ids.numel())
    for tok, hid in zip(tokens.split(chunk), hidden.split(chunk)):
        x = draft.forward_dense(tok, features(hid))[:, p - 1: t - g]
        hk, reduced = draft.chain(x, g)
        label, reached = stream_labels(reduced, to_draft[tok[:, p:].unfold(1, g, 1)])
        drafts = draft.vocab_ids[reduced.argmax(-1)]
        for acc, v in zip(out, (hk, previous_tokens(tok[:, p - 1: t - g].flatten(), drafts.flatten(0, 1)),
                                label, reached)):
            acc.append(v.flatten(0, 1) if v.dim() > 2 else v)
    return tuple(torch.cat(v) for v in out)  # type: ignore[return-value]


def reset_head(draft: DraftModel, seed: int) -> None:
    """Re-initialise the ConfidenceHead from `seed` alone: projection uniform in +-1/sqrt(fan_in) (nn.Linear's
    range; a zero projection with the zero embedding would be a stationary point of their product), zero
    bias and zero previous-token embedding (a token absent from the fit rows adds nothing)."""
    head = draft.confidence
    gen = torch.Generator().manual_seed(seed)
    bound = head.proj.in_features ** -0.5
    with torch.no_grad():
        head.proj.weight.copy_((torch.rand(head.proj.weight.shape, generator=gen) * 2 - 1) * bound)
        head.proj.bias.zero_()
        if head.embed is not None:
            head.embed.weight.zero_()


def fit_confidence(draft: DraftModel, rows: tuple[Tensor, Tensor, Tensor, Tensor], max_iter: int,
                   l2: float = 0.0) -> float:
    """Fit the ConfidenceHead alone (full batch L-BFGS, from its current weights) on the greedy
    conditional-acceptance rows; returns the final loss (without the penalty).

    `l2` x the squared norm of its weights (embedding and projection, not the bias) keeps it from
    memorising the fit streams. Measured with the first shipped draft (fit on 96 train-split streams,
    held-out BCE on 64 held-out streams; a constant per position is ~0.69): unregularised 0.97 (0.81
    without the previous-token input), l2 1e-3 0.74, 3e-3 0.71, 1e-2 0.68 (embedding driven to 0).
    Chosen for the calibration split by 2-fold cross-validation over its files (1024 streams, 4 files per
    fold; the held-out files not used): BCE l2 1e-3 0.645, 3e-3 0.649, 1e-2 0.641, 3e-2 0.637; the
    previous-token embedding frozen at 0 changes nothing (0.649 at 3e-3); half the fit streams (2 files) 0.673.
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
    """Per draft position: reached (drafts before it all matched), accepted, their ratio; and the mean
    accepted drafts per start with all gamma drafts verified."""
    reached, accepted = masks.sum(0), (labels.bool() & masks).sum(0)
    return {"reached": reached.tolist(), "accepted": accepted.tolist(),
            "rate": [round(a / max(r, 1), 4) for a, r in zip(accepted.tolist(), reached.tolist())],
            "mean_accepted": round(float((labels.bool() & masks).sum(1).float().mean()), 4)}


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
