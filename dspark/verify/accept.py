"""Capped accept: greedy and rejection sampling over strided or packed target rows (DESIGN.md 4.9).

Request r verifies `verify_lens[r]` rows (root included): drafts `0 .. verify_len-2` are checked and
rows at or past `verify_len` are never read, so acceptance is capped at `verify_len - 1` drafts while
reading. Target rows are strided `[B, W, V]` or packed `[rows, V]` with their `RaggedVerifyLayout`
(request r's row i is packed row `qo_indptr[r] + i`); accept runs on those rows directly, never
expanding packed rows to `[B*W, V]`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dspark.kernels import accept as _k
from dspark.kernels import dispatch
from dspark.util.validate import check_tensor, check_type, check_verify_lens
from dspark.verify.layout import RaggedVerifyLayout

PROB_SUM_TOL = 1e-2  # |sum(p) - 1| allowed for a probability row (bf16 rows round a little)


@dataclass(frozen=True)
class AcceptResult:
    """What one verify step commits, per request (B requests, W = gamma + 1).

    correct_lens [B] int32: drafts accepted by the target among the verified ones (leading greedy matches,
        or leading rejection-sampling accepts); at most verify_len - 1 because later rows are never read.
    commit_lens [B] int32: `min(correct_lens, verify_len - 1) + 1`, the accepted drafts plus the token
        the target supplies (the bonus).
    bonus [B] int64: the target's token after the accepted drafts: greedy argmax at row correct_lens;
        sampling: drawn from (p - q)+ at the first rejection, else from p at the last verified row.
    tokens [B, W] int64: the committed tokens, accepted drafts then the bonus, padded with -1.
    proposed [B, gamma] bool: draft i was verified (i < verify_len - 1).
    accepted [B, gamma] bool: draft i was accepted (i < correct_lens); together with `proposed`, the
        per-position acceptance labels (positions not proposed are unobserved, not rejected).
    """

    correct_lens: Tensor
    commit_lens: Tensor
    bonus: Tensor
    tokens: Tensor
    proposed: Tensor
    accepted: Tensor


def accept_greedy(draft_tokens: Tensor, target_logits: Tensor, verify_lens: Tensor,
                  layout: RaggedVerifyLayout | None = None) -> AcceptResult:
    """Greedy accept: drafts match the target argmax until the first miss; capped to verify_len - 1.

    draft_tokens [B, gamma] int; target_logits strided [B, gamma + 1, V], or packed [rows, V] with the
    layout of the forward that produced them; verify_lens [B] int in [1, gamma + 1] (<= the layout's).
    The data checks (lengths in range, draft ids in the vocabulary) cost one host read; inside
    `torch.compile` they are skipped and the call runs the torch reference (tests/package/test_compile_public.py).
    Returns the AcceptResult (same fields eager and traced).
    """
    _check_common(draft_tokens, target_logits, verify_lens, layout, "target_logits")
    return _accept_greedy(draft_tokens, target_logits, verify_lens, layout)


def _accept_greedy(draft_tokens: Tensor, target_logits: Tensor, verify_lens: Tensor,
                        layout: RaggedVerifyLayout | None = None) -> AcceptResult:
    """`accept_greedy` without its checks (no host read), for a step whose lengths and drafts were validated
    or made by the caller; arguments as `accept_greedy`."""
    vl, row_start = _lens_and_starts(draft_tokens, verify_lens, layout)
    correct, bonus = _k.greedy(draft_tokens, target_logits, vl, row_start)
    return _result(draft_tokens, correct, bonus, vl)


def accept_sampling(draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor, verify_lens: Tensor,
                    generator: torch.Generator | None = None,
                    layout: RaggedVerifyLayout | None = None) -> AcceptResult:
    """Rejection-sampling accept (lossless: committed tokens follow the target), capped to verify_len - 1.

    draft_probs [B, gamma, V]: the distributions the drafts were sampled from; target_probs strided
    [B, gamma + 1, V] or packed [rows, V] with its layout. The uniforms ([B, W]: one accept test per
    draft, one for the final draw) are drawn here from `generator`, so equal generators give equal
    results on every rank and on every backend. The data checks are `accept_greedy`'s and the probability
    rows' (host reads; skipped inside `torch.compile`).
    """
    vl, row_start = _check_common(draft_tokens, target_probs, verify_lens, layout, "target_probs")
    check_type("generator", generator, torch.Generator, optional=True)
    b, gamma = draft_tokens.shape
    if check_tensor("draft_probs", draft_probs).shape != (b, gamma, target_probs.shape[-1]):
        raise ValueError(
            f"draft_probs must be [B={b}, gamma={gamma}, V={target_probs.shape[-1]}], "
            f"got {tuple(draft_probs.shape)}"
        )
    if not dispatch.tracing():
        verified = torch.arange(gamma + 1, device=vl.device)[None, :] < vl[:, None]
        _check_probs("target_probs", _row_stats(target_probs, row_start, gamma + 1), verified)
        _check_probs("draft_probs", _row_stats(draft_probs, None, gamma), verified[:, 1:])
    return _accept_sampling(draft_tokens, draft_probs, target_probs, verify_lens, generator, layout)


def _accept_sampling(draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor, verify_lens: Tensor,
                          generator: torch.Generator | None = None,
                          layout: RaggedVerifyLayout | None = None) -> AcceptResult:
    """`accept_sampling` without its checks (no host read); arguments as `accept_sampling`."""
    vl, row_start = _lens_and_starts(draft_tokens, verify_lens, layout)
    uniforms = _uniforms(draft_tokens.shape[0], draft_tokens.shape[1] + 1, generator, draft_tokens.device)
    correct, bonus = _k.sampling(draft_tokens, draft_probs, target_probs, vl, row_start, uniforms)
    return _result(draft_tokens, correct, bonus, vl)


def _lens_and_starts(draft: Tensor, verify_lens: Tensor, layout: RaggedVerifyLayout | None
                     ) -> tuple[Tensor, Tensor | None]:
    """int32 verify_lens on the drafts' device and the packed rows' starts (None for strided rows)."""
    row_start = layout.qo_indptr[:-1].to(draft.device) if layout is not None else None
    return verify_lens.to(device=draft.device, dtype=torch.int32), row_start


def _uniforms(b: int, w: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """[B, W] float32 uniforms from the generator (on its device), moved to the data's device."""
    where = generator.device if generator is not None else device
    return torch.rand((b, w), generator=generator, device=where, dtype=torch.float32).to(device)


def _result(draft: Tensor, correct: Tensor, bonus: Tensor, verify_lens: Tensor) -> AcceptResult:
    b, gamma = draft.shape
    pos = torch.arange(gamma + 1, device=draft.device)[None, :]
    padded = torch.cat([draft.to(torch.int64), torch.zeros(b, 1, dtype=torch.int64, device=draft.device)], 1)
    c = correct[:, None].to(torch.int64)
    tokens = torch.where(pos < c, padded, torch.where(pos == c, bonus[:, None], torch.full_like(padded, -1)))
    commit = (torch.minimum(correct, verify_lens - 1) + 1).to(torch.int32)
    return AcceptResult(
        correct_lens=correct,
        commit_lens=commit,
        bonus=bonus,
        tokens=tokens,
        proposed=pos[:, :gamma] < (verify_lens[:, None] - 1),
        accepted=pos[:, :gamma] < c,
    )


# ---------------------------------------------------------------- validation (API boundary; syncs)

def _check_common(draft: Tensor, target: Tensor, verify_lens: Tensor, layout: RaggedVerifyLayout | None,
                  name: str) -> tuple[Tensor, Tensor | None]:
    """Validate shapes, lengths and draft ids (not inside `torch.compile`: they read the device); return int32
    verify_lens and the packed row starts."""
    if not isinstance(draft, Tensor) or draft.dim() != 2 or draft.dtype.is_floating_point:
        raise TypeError(f"draft_tokens must be an integer [B, gamma] tensor, got {_desc(draft)}")
    b, gamma = draft.shape
    if gamma < 1:
        raise ValueError(f"draft_tokens must hold gamma >= 1 drafts per request, got shape {tuple(draft.shape)}")
    w = gamma + 1
    check_tensor(name, target)
    check_type("layout", layout, RaggedVerifyLayout, optional=True)
    if not isinstance(verify_lens, Tensor) or verify_lens.shape != (b,) or verify_lens.dtype.is_floating_point:
        raise ValueError(f"verify_lens must be an integer [B={b}] tensor, got {_desc(verify_lens)}")
    vl = verify_lens.to(device=draft.device, dtype=torch.int32)
    if layout is None:
        if target.dim() != 3 or target.shape[:2] != (b, w):
            raise ValueError(f"strided {name} must be [B={b}, W={w}, V], got {tuple(target.shape)}"
                             " (pass layout= for packed rows)")
        row_start = None
    else:
        if layout.num_requests != b:
            raise ValueError(f"layout has {layout.num_requests} requests, draft_tokens has {b}")
        rows = layout.total_rows if layout.total_rows is not None else layout.graph_num_tokens
        if target.dim() != 2 or target.shape[0] < rows:
            raise ValueError(f"packed {name} must be [rows >= {rows}, V], got {tuple(target.shape)}")
        row_start = layout.qo_indptr[:-1].to(draft.device)
    vocab = target.shape[-1]
    if vocab < 1:
        raise ValueError(f"{name} has an empty vocabulary: shape {tuple(target.shape)}")
    if dispatch.tracing():  # the data checks read the device: not in a traced step
        return vl, row_start
    # every data check below in one host read; the first failing one is then named in order
    bad_len = (vl < 1) | (vl > w)
    over = vl > layout.verify_lens.to(vl.device) if layout is not None else torch.zeros_like(bad_len)
    verified = torch.arange(gamma, device=draft.device)[None, :] < (vl[:, None] - 1)
    bad = verified & ((draft < 0) | (draft >= vocab))
    len_failed, over_failed, draft_failed = torch.stack([bad_len.any(), over.any(), bad.any()]).tolist()
    if len_failed:
        check_verify_lens(vl, w)
    if over_failed:
        r = int(over.nonzero()[0])
        raise ValueError(f"verify_lens[{r}] = {int(vl[r])} exceeds the rows the layout gave request {r}: "
                         f"{int(layout.verify_lens[r])}")
    if draft_failed:
        r, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"draft_tokens[{r}, {i}] = {int(draft[r, i])} is outside the vocabulary [0, {vocab})")
    return vl, row_start


def _row_stats(probs: Tensor, row_start: Tensor | None, w: int) -> tuple[Tensor, Tensor]:
    """(min, sum) over the vocabulary per (request, position): [B, w] each, O(rows) memory."""
    lo, total = probs.amin(-1).float(), probs.sum(-1, dtype=torch.float32)
    if row_start is None:
        return lo, total
    b = row_start.numel()
    if lo.numel() == 0:
        return (torch.zeros(b, w, device=probs.device),) * 2
    idx = _k.row_index(row_start, b, w, probs.device).clamp(max=lo.numel() - 1)
    return lo[idx], total[idx]


def _check_probs(name: str, stats: tuple[Tensor, Tensor], verified: Tensor) -> None:
    lo, total = stats
    checks = (
        (lo.isnan() | total.isnan(), "holds NaN"),
        (lo < 0, "has a negative entry {lo:.4g}"),
        ((total - 1).abs() > PROB_SUM_TOL, f"sums to {{total:.6g}}, not 1 (tolerance {PROB_SUM_TOL})"),
    )
    for bad, what in checks:
        bad = bad & verified
        if bool(bad.any()):
            r, i = (int(x) for x in bad.nonzero()[0])
            msg = what.format(lo=float(lo[r, i]), total=float(total[r, i]))
            raise ValueError(f"{name} row (request {r}, position {i}) {msg}")


def _desc(x: object) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return repr(x)
