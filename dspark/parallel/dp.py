"""Data-parallel agreement on the graph tier (DESIGN.md 4.10): `DpTierAgreement` does one all-gather of
`(requests, rows)` per step on a CPU (gloo) group; every DP rank replays the tier of the largest row
count; an idle rank builds a ghost-only layout and joins the collective."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from dspark.parallel.tp import group_ranks
from dspark.util.validate import check_int
from dspark.verify.layout import RaggedVerifyLayout, check_tiers, round_up_to_tier


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

    cpu_group: a gloo (CPU) group; tiers: captured token tiers; graph_slots: captured slot count S (idle
    ranks fill ghost slots); width: W = gamma + 1.
    """

    def __init__(
        self,
        cpu_group: dist.ProcessGroup | None = None,
        tiers: Sequence[int] | None = None,
        graph_slots: int | None = None,
        width: int | None = None,
    ):
        self.ranks = group_ranks(cpu_group, "cpu_group")
        backend = str(dist.get_backend(cpu_group)).lower()
        if not any(name in backend for name in ("gloo", "mpi", "ucc")):
            raise ValueError(f"the DP tier group must be a CPU (gloo) group, got backend {backend!r}")
        for name, v in (("graph_slots", graph_slots), ("width", width)):
            if v is not None:
                check_int(name, v, 1)
        self.group = cpu_group
        self.tiers = check_tiers(tiers)
        self.graph_slots = graph_slots
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
            if self.graph_slots is not None and b > self.graph_slots:
                raise ValueError(f"DP rank {rank} has {b} requests, more than the {self.graph_slots} captured slots")
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
        ghosts = self.graph_slots - num_requests if self.graph_slots is not None else 1
        return ghosts * self.width if self.width is not None else (float("inf") if ghosts else 0)

    def layout(self, verify_lens: Tensor, decision: DpTier) -> RaggedVerifyLayout:
        """This rank's layout under the DP-global decision (an idle rank gets ghost rows only)."""
        lens = verify_lens.to(torch.int32)
        if decision.tier is not None:
            return RaggedVerifyLayout.from_verify_lens(
                lens, (decision.tier,), self.graph_slots, width=self.width, on_overflow="error"
            )
        if lens.shape[0]:
            out = RaggedVerifyLayout.from_verify_lens(lens, None, self.graph_slots, width=self.width)
        else:
            out = self._idle_eager_layout(lens)
        return dataclasses.replace(out, eager_reason=decision.eager_reason)

    def _idle_eager_layout(self, lens: Tensor) -> RaggedVerifyLayout:
        """Eager idle step: one ghost row per slot, the smallest forward that still joins the collective."""
        n = self.graph_slots or 1
        out = RaggedVerifyLayout.from_verify_lens(lens, (n,), n, width=1)
        return dataclasses.replace(out, width=self.width, tier=None)

    def step(self, verify_lens: Tensor) -> tuple[RaggedVerifyLayout, DpTier]:
        """`agree` then `layout`: the per-step entry point."""
        decision = self.agree(verify_lens)
        return self.layout(verify_lens, decision), decision
