"""Agreement across tensor- and data-parallel ranks on torch.distributed (DESIGN.md 4.10).

In production the planner runs on every rank. Two tensor-parallel (TP) ranks holding different
`verify_lens`, or two data-parallel (DP) ranks replaying different graph tiers, issue collectives of
different shapes and hang. This module makes the agreement explicit and cheap, and turns every
disagreement into an error that names the ranks:

- `TpAgreement`: `mode="broadcast"` checks that every rank holds the same B (one 2-element int32 MAX
  all-reduce) and sends the group's first rank's `verify_lens` to the others; `mode="verify"` keeps the
  locally computed lens (the planner's inputs are replicated) and checks them with one 4-element int32
  MAX all-reduce of a 62-bit hash (MIN folded into MAX by bitwise not). A mismatch, or a rank's invalid
  input, raises on every rank in the same step.
- `DpTierAgreement`: one all-gather of `(requests, rows)` per step on a CPU (gloo) group; every DP rank
  replays the tier of the largest row count; an idle rank builds a ghost-only layout and joins.
- `check_cost_table`: the budget is computed from replicated inputs (lagged survival, same cost table),
  so ranks agree without a per-step collective; the table's fingerprint is compared once at start-up.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from dspark._validate import check_int, check_type
from dspark.layout import RaggedVerifyLayout, check_tiers, round_up_to_tier

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


def _group_ranks(group: dist.ProcessGroup | None, name: str = "group") -> list[int]:
    check_type(name, group, dist.ProcessGroup, optional=True)
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _by_value(values: Sequence[object], ranks: Sequence[int]) -> dict[object, list[int]]:
    """Global ranks grouped by the value they reported, in first-seen order (the first rank's first)."""
    out: dict[object, list[int]] = {}
    for v, r in zip(values, ranks):
        out.setdefault(v, []).append(r)
    return out


def _local_lens(verify_lens: object) -> tuple[Tensor | None, str | None]:
    """(lens as int32, None), or (None, what is wrong) for input that is not a 1-D integer tensor. The
    problem is not raised before the collective: the other ranks would wait in it forever."""
    if not isinstance(verify_lens, Tensor):
        return None, f"verify_lens must be a torch.Tensor, got {type(verify_lens).__name__}: {verify_lens!r}"
    dtype = verify_lens.dtype
    if verify_lens.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return None, (f"verify_lens must be a 1-D integer tensor, got {verify_lens.dtype} "
                      f"{tuple(verify_lens.shape)}")
    return verify_lens.to(torch.int32), None


_INVALID = -1  # reported in place of B (and of the hash) by a rank whose own input is invalid


class TpAgreement:
    """Identical `verify_lens` on every rank of a tensor-parallel group, or an error naming the ranks.

    Every disagreement (batch size, value, or a rank's invalid input) is found by the step's collective
    on every rank at once, so all ranks raise `TpDisagreementError` in the same step and none is left
    waiting in a collective the others skipped.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, mode: str = "verify"):
        if mode not in TP_MODES:
            raise ValueError(f"mode must be one of {TP_MODES}, got {mode!r}")
        self.group = group
        self.mode = mode
        self.ranks = _group_ranks(group)

    def agree(self, verify_lens: Tensor) -> Tensor:
        """The group's `verify_lens` for this step ([B] int32 on the input's device).

        broadcast: one MAX all-reduce of (B, ~B) checks that every rank holds the same B (a replicated
        TP batch does), then the first rank's lens overwrite the others'. verify: one MAX all-reduce of
        a hash of (B, lens) and its complement. Either way a mismatch raises on every rank in the same
        step, so no rank proceeds into a hanging forward. The check reads a few ints on the host, a sync
        the layout build makes anyway.
        """
        lens, problem = _local_lens(verify_lens)
        if len(self.ranks) == 1:
            if problem:
                raise TypeError(problem)
            return lens
        device = lens.device if lens is not None else _collective_device(self.group)
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
        groups = _by_value(reports, self.ranks)
        differ = [r for rep, rs in groups.items() if rep != reports[0] for r in rs]
        detail = "; ".join(f"ranks {rs} {_describe(rep, self.mode)}" for rep, rs in groups.items())
        what = "the batch size B" if self.mode == "broadcast" else "verify_lens"
        fix = ("every TP rank must plan the same requests (B); the first rank's verify_lens are then sent to "
               "the others" if self.mode == "broadcast" else
               "the planner inputs (logits, slots, generations, cost table) are not replicated across the TP "
               "group; use tp_mode='broadcast' or fix the replication")
        own = f" This rank: {problem}." if problem else ""
        raise TpDisagreementError(
            f"TP ranks disagree on {what}: ranks {differ} differ from rank {self.ranks[0]}: {detail}. "
            f"In tp_mode={self.mode!r} {fix}.{own}",
            differ,
        )


def _describe(report: tuple[int, int, int], mode: str) -> str:
    h1, h2, b = report
    if b == _INVALID:
        return "hold invalid verify_lens (not a 1-D integer tensor)"
    return f"hold B={b}" if mode == "broadcast" else f"hold verify_lens hash {_hash_hex(h1, h2)} (B={b})"


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a rank without a usable tensor puts its report: the group backend's device."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "hccl" in backend:
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")


@dataclass(frozen=True)
class DpTier:
    """The DP-global decision for one step (same on every DP rank)."""

    tier: int | None           # tier every DP rank replays; None = every DP rank runs eager
    requests: tuple[int, ...]  # requests per DP rank, in group-rank order (0 = idle)
    rows: tuple[int, ...]      # verify rows per DP rank
    eager_reason: str | None   # why no tier, naming a global rank (None: tier used, or no tiers)

    @property
    def idle_ranks(self) -> tuple[int, ...]:
        """Group-rank indices with no request this step (they join the forward with ghost rows only)."""
        return tuple(i for i, b in enumerate(self.requests) if b == 0)


class DpTierAgreement:
    """DP-global graph tier: every DP rank replays the tier of the largest row count across ranks.

    cpu_group: a gloo (CPU) group; tiers: captured token tiers; slots: captured slot count S (idle
    ranks fill ghost slots); width: W = gamma + 1.
    """

    def __init__(
        self,
        cpu_group: dist.ProcessGroup | None = None,
        tiers: Sequence[int] | None = None,
        slots: int | None = None,
        width: int | None = None,
    ):
        self.ranks = _group_ranks(cpu_group, "cpu_group")
        backend = str(dist.get_backend(cpu_group)).lower()
        if not any(name in backend for name in ("gloo", "mpi", "ucc")):
            raise ValueError(f"the DP tier group must be a CPU (gloo) group, got backend {backend!r}")
        for name, v in (("slots", slots), ("width", width)):
            if v is not None:
                check_int(name, v, 1)
        self.group = cpu_group
        self.tiers = check_tiers(tiers)
        self.slots = slots
        self.width = width

    def agree(self, verify_lens: Tensor) -> DpTier:
        """Gather `(requests, rows)` from every DP rank (one CPU all-gather) and pick the global tier."""
        lens = verify_lens.to(torch.int32)
        mine = torch.tensor([lens.shape[0], int(lens.sum())], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in self.ranks]
        dist.all_gather(parts, mine, group=self.group)
        requests = tuple(int(p[0]) for p in parts)
        rows = tuple(int(p[1]) for p in parts)
        return self.decide(requests, rows)

    def decide(self, requests: Sequence[int], rows: Sequence[int]) -> DpTier:
        """The global decision from every rank's `(requests, rows)`: a pure function, same on all ranks.

        The tier is the round-up of the largest row count. Every rank runs eager instead (reason
        recorded) when that count is past the largest tier, or when some rank's padding to the tier
        does not fit its ghost slots ((slots - requests) * width rows). Too many requests for the
        captured slots raises on every rank (naming the rank), never on one rank alone.
        """
        requests, rows = tuple(requests), tuple(rows)
        if not len(requests) == len(rows) == len(self.ranks):
            raise ValueError(
                f"need one (requests, rows) per DP rank ({len(self.ranks)}), got {len(requests)} and {len(rows)}"
            )
        for rank, b in zip(self.ranks, requests):
            if self.slots is not None and b > self.slots:
                raise ValueError(f"DP rank {rank} has {b} requests, more than the {self.slots} captured slots")
        if not self.tiers:
            return DpTier(None, requests, rows, None)
        top = max(range(len(rows)), key=rows.__getitem__)
        tier = round_up_to_tier(rows[top], self.tiers)
        if tier is None:
            reason = (
                f"DP rank {self.ranks[top]} has {rows[top]} verify rows, past the largest captured tier "
                f"{self.tiers[-1]}: every DP rank runs this step eager"
            )
            return DpTier(None, requests, rows, reason)
        for rank, b, n in zip(self.ranks, requests, rows):
            if tier - n > self._ghost_capacity(b):
                reason = (
                    f"DP rank {rank} needs {tier - n} padding rows to reach tier {tier} but its "
                    f"{b} requests leave ghost room for {self._ghost_capacity(b)}: every DP rank "
                    "runs this step eager (capture more slots for this tier)"
                )
                return DpTier(None, requests, rows, reason)
        return DpTier(tier, requests, rows, None)

    def _ghost_capacity(self, num_requests: int) -> float:
        """Padding rows a rank's ghost slots can hold (the layout's rule: at most W rows per ghost)."""
        ghosts = self.slots - num_requests if self.slots is not None else 1
        return ghosts * self.width if self.width is not None else (float("inf") if ghosts else 0)

    def layout(self, verify_lens: Tensor, decision: DpTier) -> RaggedVerifyLayout:
        """This rank's layout under the DP-global decision (an idle rank gets ghost rows only)."""
        lens = verify_lens.to(torch.int32)
        if decision.tier is not None:
            return RaggedVerifyLayout.from_verify_lens(
                lens, (decision.tier,), self.slots, width=self.width, on_overflow="error"
            )
        if lens.shape[0]:
            out = RaggedVerifyLayout.from_verify_lens(lens, None, self.slots, width=self.width)
        else:
            out = self._idle_eager_layout(lens)
        return dataclasses.replace(out, eager_reason=decision.eager_reason)

    def _idle_eager_layout(self, lens: Tensor) -> RaggedVerifyLayout:
        """Eager idle step: one ghost row per slot, the smallest forward that still joins the collective."""
        n = self.slots or 1
        out = RaggedVerifyLayout.from_verify_lens(lens, (n,), n, width=1)
        return dataclasses.replace(out, width=self.width, tier=None)

    def step(self, verify_lens: Tensor) -> tuple[RaggedVerifyLayout, DpTier]:
        """`agree` then `layout`: the per-step entry point."""
        decision = self.agree(verify_lens)
        return self.layout(verify_lens, decision), decision


def check_cost_table(group: dist.ProcessGroup | None, fingerprint: str) -> None:
    """Start-up check: every rank of `group` must hold the same cost-table fingerprint.

    Collective (all ranks call it). On a mismatch every rank raises `CostTableMismatchError` naming the
    ranks and both fingerprints, so a rank restarted with another table is refused instead of
    silently planning different budgets (which would then hang the TP forward).
    """
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"fingerprint must be a non-empty str, got {fingerprint!r}")
    ranks = _group_ranks(group)
    if len(ranks) == 1:
        return
    gathered: list[object] = [None] * len(ranks)
    dist.all_gather_object(gathered, fingerprint, group=group)
    ref = gathered[0]
    differ = [r for r, f in zip(ranks, gathered) if f != ref]
    if not differ:
        return
    me = dist.get_rank()
    who = (
        f"rank {me} is refused: its cost table {fingerprint} differs from {ref} (rank {ranks[0]})"
        if fingerprint != ref else f"rank {me} holds the group's table {ref}"
    )
    detail = "; ".join(f"ranks {rs} have {f}" for f, rs in _by_value(gathered, ranks).items())
    raise CostTableMismatchError(
        f"cost table fingerprints differ across ranks ({detail}); {who}. Load the same cost table on "
        "every rank: the budget is computed locally from replicated inputs and must match.",
        differ,
    )


class ParallelAgreement:
    """The planner's view: the start-up check, then per step `verify_lens` (TP) and `dp.step` (DP)."""

    def __init__(
        self,
        config: ParallelConfig,
        *,
        fingerprint: str,
        tiers: Sequence[int] | None = None,
        slots: int | None = None,
        width: int | None = None,
    ):
        self.config = config
        self.tp = TpAgreement(config.tp_group, config.tp_mode) if config.tp_group is not None else None
        self.dp = (
            DpTierAgreement(config.dp_group, tiers, slots, width) if config.dp_group is not None else None
        )
        for group in {id(g): g for g in (config.tp_group, config.dp_group) if g is not None}.values():
            check_cost_table(group, fingerprint)

    def verify_lens(self, verify_lens: Tensor) -> Tensor:
        """TP-agreed lens (unchanged without a TP group)."""
        return self.tp.agree(verify_lens) if self.tp is not None else verify_lens
