"""Tensor-parallel agreement on `verify_lens` (DESIGN.md 4.10), and the error types every agreement raises.

`TpAgreement`: `mode="broadcast"` checks that every rank holds the same B (one 2-element int32 MAX
all-reduce) and sends the group's first rank's `verify_lens` to the others; `mode="verify"` keeps the
locally computed lens (the planner's inputs are replicated) and checks them with one 4-element int32 MAX
all-reduce of a 62-bit hash (MIN folded into MAX by bitwise not). A mismatch, or a rank's invalid input,
raises on every rank in the same step, naming the ranks: ranks must hold identical lens, a disagreement
is a hang in production.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from dspark.util.validate import check_type

TP_MODES = ("verify", "broadcast")

# Two primes below 2**31 and bases for two independent polynomial hashes: every product of two residues
# is < 2**62 and every per-request sum stays < 2**63 for B < 2**32, so the int64 arithmetic is exact on
# every device and each residue fits an int32 collective (Ascend/HCCL-friendly, no int64 reductions).
_PRIMES = (2_147_483_647, 2_147_483_629)
_BASES = (48_271, 69_621)
_coeff_cache: dict[tuple[str, int | None], tuple[Tensor, Tensor]] = {}


class AgreementError(RuntimeError):
    """Ranks that must agree do not; `ranks` are the global ranks that differ from the group's first."""

    def __init__(self, message: str, ranks: Sequence[int]):
        super().__init__(message)
        self.ranks = tuple(ranks)


class TpDisagreementError(AgreementError):
    """TP ranks hold different `verify_lens` for the same step."""


class CostTableMismatchError(AgreementError):
    """Ranks loaded cost tables with different fingerprints."""


class PlanningConfigMismatchError(AgreementError):
    """Ranks built their planners with different planning configurations (tiers, slots, temperatures, ...)."""


@dataclass(frozen=True)
class ParallelConfig:
    """How a `VerifyPlanner` agrees with its peers.

    tp_group: the tensor-parallel group (its backend's device holds `verify_lens`; None = no TP).
    dp_group: a CPU (gloo) group over every rank that must replay the same tier (None = no DP); the
      whole world is fine, TP peers report identical rows.
    tp_mode: "verify" (local lens + hash check) or "broadcast" (the TP group's first rank decides).
    """

    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    tp_mode: str = "verify"

    def __post_init__(self) -> None:
        if self.tp_mode not in TP_MODES:
            raise ValueError(f"tp_mode must be one of {TP_MODES}, got {self.tp_mode!r}")


def verify_lens_hash(verify_lens: Tensor) -> Tensor:
    """[2] int64 hash of `(B, verify_lens)`, each entry in [0, 2**31): exact, device-side, no sync.

    Entry j is `(B * g_j + sum_r verify_lens[r] * g_j**(r+2)) mod p_j`. Two different vectors collide
    only where both polynomials of their difference vanish at the fixed bases: about B**2 / 2**62.
    """
    if verify_lens.dim() != 1 or verify_lens.dtype.is_floating_point or verify_lens.dtype == torch.bool:
        raise TypeError(
            f"verify_lens must be a 1-D integer tensor, got {verify_lens.dtype} {tuple(verify_lens.shape)}"
        )
    b = verify_lens.shape[0]
    head = torch.full((1,), b, dtype=torch.int64, device=verify_lens.device)
    x = torch.cat([head, verify_lens.to(torch.int64)])
    coeffs, primes = _coefficients(b + 1, x.device)
    terms = torch.remainder(torch.remainder(x, primes) * coeffs, primes)
    return torch.remainder(terms.sum(dim=1), primes[:, 0])


def _coefficients(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """[2, n] int64 powers `g_j**(k+1) mod p_j` and the [2, 1] primes, cached per device.

    The power table grows to the next power of two of the largest batch seen.
    """
    key = (device.type, device.index)
    cached = _coeff_cache.get(key)
    if cached is None or cached[0].shape[1] < n:
        size = 1 << max(n - 1, 1).bit_length()
        rows = []
        for p, g in zip(_PRIMES, _BASES):
            acc, row = 1, []
            for _ in range(size):
                acc = acc * g % p
                row.append(acc)
            rows.append(row)
        primes = torch.tensor(_PRIMES, dtype=torch.int64, device=device).unsqueeze(1)
        cached = _coeff_cache[key] = (torch.tensor(rows, dtype=torch.int64, device=device), primes)
    return cached[0][:, :n], cached[1]


def _hash_hex(h1: int, h2: int) -> str:
    return f"{(h1 << 31) | h2:016x}"


def group_ranks(group: dist.ProcessGroup | None, name: str = "group") -> list[int]:
    check_type(name, group, dist.ProcessGroup, optional=True)
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def by_value(values: Sequence[object], ranks: Sequence[int]) -> dict[object, list[int]]:
    """Global ranks grouped by the value they reported, in first-seen order (the first rank's first)."""
    out: dict[object, list[int]] = {}
    for v, r in zip(values, ranks):
        out.setdefault(v, []).append(r)
    return out


def _local_lens(verify_lens: object, what: str = "verify_lens") -> tuple[Tensor | None, str | None]:
    """(lens as int32, None), or (None, what is wrong) for input that is not a 1-D integer tensor. The
    problem is not raised before the collective: the other ranks would wait in it forever."""
    if not isinstance(verify_lens, Tensor):
        return None, f"{what} must be a torch.Tensor, got {type(verify_lens).__name__}: {verify_lens!r}"
    dtype = verify_lens.dtype
    if verify_lens.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return None, (f"{what} must be a 1-D integer tensor, got {verify_lens.dtype} "
                      f"{tuple(verify_lens.shape)}")
    return verify_lens.to(torch.int32), None


_INVALID = -1  # reported in place of B (and of the hash) by a rank whose own input is invalid


class TpAgreement:
    """Identical `verify_lens` on every rank of a tensor-parallel group, or an error naming the ranks.

    Every disagreement (batch size, value, or a rank's invalid input) is found by the step's collective
    on every rank at once, so all ranks raise `TpDisagreementError` in the same step and none is left
    waiting in a collective the others skipped. `what` names the agreed vector in messages (any 1-D
    integer tensor agrees the same way: `dspark.parallel.agreement.EstimatorAgreement` sends float bits).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, mode: str = "verify", what: str = "verify_lens"):
        if mode not in TP_MODES:
            raise ValueError(f"mode must be one of {TP_MODES}, got {mode!r}")
        self.group = group
        self.mode = mode
        self.what = check_type("what", what, str)
        self.ranks = group_ranks(group)

    def agree(self, verify_lens: Tensor) -> Tensor:
        """The group's `verify_lens` for this step ([B] int32 on the input's device).

        broadcast: one MAX all-reduce of (B, ~B) checks that every rank holds the same B (a replicated
        TP batch does), then the first rank's lens overwrite the others'. verify: one MAX all-reduce of
        a hash of (B, lens) and its complement. Either way a mismatch raises on every rank in the same
        step, so no rank proceeds into a hanging forward. The check reads a few ints on the host, a sync
        the layout build makes anyway.
        """
        lens, problem = _local_lens(verify_lens, self.what)
        if len(self.ranks) == 1:
            if problem:
                raise TypeError(problem)
            return lens
        device = lens.device if lens is not None else collective_device(self.group)
        if self.mode == "broadcast":
            mine = torch.tensor([_INVALID if problem else lens.shape[0]], dtype=torch.int32, device=device)
        else:
            mine = (torch.full((2,), _INVALID, dtype=torch.int32, device=device) if problem
                    else verify_lens_hash(lens).to(torch.int32))
        folded = torch.cat([mine, torch.bitwise_not(mine)])
        dist.all_reduce(folded, op=dist.ReduceOp.MAX, group=self.group)
        n = mine.numel()
        if not torch.equal(folded[:n], torch.bitwise_not(folded[n:])):
            self._raise_disagreement(mine, _INVALID if problem else lens.shape[0], problem)
        if problem:  # every rank's input is invalid: all raise here, in the same step
            raise TypeError(problem)
        if self.mode == "broadcast":
            lens = lens.clone()  # `.to` may have returned the caller's own tensor
            dist.broadcast(lens, group=self.group, group_src=0)
        return lens

    def _raise_disagreement(self, digest: Tensor, batch: int, problem: str | None) -> None:
        """Failure path only: every rank gathers (hash, B) to name who differs, then raises."""
        pad = torch.full((2 - digest.numel(),), _INVALID, dtype=torch.int32, device=digest.device)
        mine = torch.cat([digest, pad, torch.tensor([batch], dtype=torch.int32, device=digest.device)])
        parts = [torch.empty_like(mine) for _ in self.ranks]
        dist.all_gather(parts, mine, group=self.group)
        reports = [(int(p[0]), int(p[1]), int(p[2])) for p in parts]
        groups = by_value(reports, self.ranks)
        differ = [r for rep, rs in groups.items() if rep != reports[0] for r in rs]
        detail = "; ".join(f"ranks {rs} {_describe(rep, self.mode, self.what)}" for rep, rs in groups.items())
        what = "the batch size B" if self.mode == "broadcast" else self.what
        fix = (f"every TP rank must plan the same requests (B); the first rank's {self.what} are then sent to "
               "the others" if self.mode == "broadcast" else
               f"the inputs of {self.what} are not replicated across the TP group (planner: logits, slots, "
               "generations, cost table; online estimator: draft logits and accept outcomes); use "
               "tp_mode='broadcast' or fix the replication")
        own = f" This rank: {problem}." if problem else ""
        raise TpDisagreementError(
            f"TP ranks disagree on {what}: ranks {differ} differ from rank {self.ranks[0]}: {detail}. "
            f"In tp_mode={self.mode!r} {fix}.{own}",
            differ,
        )


def _describe(report: tuple[int, int, int], mode: str, what: str) -> str:
    h1, h2, b = report
    if b == _INVALID:
        return f"hold invalid {what} (not a 1-D integer tensor)"
    return f"hold B={b}" if mode == "broadcast" else f"hold {what} hash {_hash_hex(h1, h2)} (B={b})"


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a rank without a usable tensor puts its report: the group backend's device."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "hccl" in backend:
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")
