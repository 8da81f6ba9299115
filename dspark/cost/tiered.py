"""`TieredCostModel`: `T = bias + alpha(B) + phi(tier(M))`, keyed on the graph tier the step replays, the
error of a cost model at tier edges (`tier_edge_errors`) and the tiers worth replaying (`serving_tiers`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from dspark.cost.base import (
    BatchTerm,
    CostModel,
    FitReport,
    ProfileSample,
    check_curve,
    check_probes,
    check_samples,
    check_values,
    interp,
    is_real,
    register_cost_model,
    require_full_rank,
    set_bias_and_batch_term,
)
from dspark.util.validate import check_type


def tier_index(rows: Tensor, tiers: Tensor) -> Tensor:
    """Index of the smallest tier >= rows (len(tiers) past the largest): `dspark.verify.layout.round_up_to_tier`."""
    return torch.searchsorted(tiers, rows.contiguous(), right=False)


def tier_edge_errors(model: CostModel, samples: Sequence[ProfileSample], tiers: Sequence[int],
                     offsets: Sequence[int] = (-2, -1, 0, 1, 2)) -> dict[str, dict[str, float]]:
    """Relative error (predicted / measured - 1) at each tier + offset, averaged over the samples there.

    Keys are str(tier) -> str(offset); points without samples, and rows past the largest tier (eager
    steps), are left out. This is where a smooth fit across a tier cliff is most wrong.
    """
    out: dict[str, dict[str, float]] = {}
    for t in tiers:
        for d in offsets:
            at = [s for s in samples if s.rows == t + d <= tiers[-1]]
            if at:
                err = [float(model.step_seconds(s.num_requests, s.rows)) / s.seconds - 1.0 for s in at]
                out.setdefault(str(t), {})[str(d)] = sum(err) / len(err)
    return out


def serving_tiers(samples: Sequence[ProfileSample], tiers: Sequence[int], margin: float = 0.05) -> tuple[int, ...]:
    """The profiled tiers worth replaying: a tier is left out when, at every batch size that measured it, a
    larger tier measured at that batch size ran at least `margin` faster (median seconds of the cells).

    Why: a step may pad past its tier to any larger one, so a tier that costs more than a larger one is
    never worth its graph: padding to the larger tier verifies more rows in less time. A CPU's matmul
    kernels change with the row count, so a larger tier can run faster than a smaller one (docs/demo.md);
    `margin` keeps timing noise between two near-equal tiers from dropping one. The largest tier is always
    kept; samples past it (eager steps) are ignored.
    """
    samples = check_samples(samples)
    tiers = check_probes("tiers", tiers, 1)
    if not (is_real(margin) and 0 <= margin < 1):
        raise ValueError(f"margin must be a number in [0, 1), got {margin!r}")
    idx = tier_index(torch.tensor([float(s.rows) for s in samples], dtype=torch.float64),
                     torch.tensor(tiers, dtype=torch.float64)).tolist()
    cells: dict[tuple[int, int], list[float]] = {}
    for s, i in zip(samples, idx):
        if i < len(tiers):
            cells.setdefault((s.num_requests, tiers[i]), []).append(s.seconds)
    median = {key: float(torch.tensor(v, dtype=torch.float64).median()) for key, v in cells.items()}

    def dominated(tier: int) -> bool:
        at = [(b, v) for (b, t), v in median.items() if t == tier]
        return bool(at) and all(any(t > tier and u <= (1 - margin) * v for (c, t), u in median.items() if c == b)
                                for b, v in at)

    return tuple(t for t in tiers[:-1] if not dominated(t)) + (tiers[-1],)


def _components(pairs: Sequence[tuple[int, int]]) -> list[tuple[list[int], list[int]]]:
    """Connected components of the bipartite graph B-level <-> tier-level joined by the samples."""
    parent: dict[tuple[str, int], tuple[str, int]] = {}

    def find(x: tuple[str, int]) -> tuple[str, int]:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for b, t in pairs:
        parent[find(("B", b))] = find(("tier", t))
    groups: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
    for node in sorted(parent):
        bs, ts = groups.setdefault(find(node), ([], []))
        (bs if node[0] == "B" else ts).append(node[1])
    return list(groups.values())


@dataclass(frozen=True)
class TierTerm:
    """phi(tier) of `TieredCostModel`: seconds `phi[i]` of a step that replays tier `tiers[i]` (ints >= 1,
    strictly increasing; finite values, one per tier)."""

    tiers: Sequence[int]
    phi: Sequence[float]

    def __post_init__(self) -> None:
        check_curve(self, "tiers", "phi", 1)


@register_cost_model
class TieredCostModel(CostModel):
    """Cost keyed on the tier the step replays: T(B, M) = bias + alpha(B) + phi(tier(M)).

    tier(M) is the smallest captured tier >= M, the same round-up the runtime uses, so the model is a
    staircase: one value per tier, constant inside it. The budget argmax (`choose_budget`) therefore
    lands on a tier top (the most rows the paid tier holds) or on the last candidate: the budget
    decision and the tier fill are one decision. alpha(B) is interpolated linearly between batch probes
    (held outside them). With `table` ([batch probe][tier] seconds) the dense table replaces
    bias + alpha + phi (still linear in B per tier). Past the largest tier the step would run eager:
    the model predicts +inf there, so the planner never chooses to leave the captured tiers.

    Args:
        bias: seconds every step pays.
        batch_term: alpha(B) (`BatchTerm`); tier_term: phi(tier) (`TierTerm`). The model exposes their probes and
            values flat: `batch_probes`, `alpha`, `tiers`, `phi`.
        table: [batch probe][tier] seconds replacing bias + alpha + phi, or None.
        platform / width / fit_report: as `CostModel`.
    """

    kind = "tiered"

    def __init__(self, bias: float, batch_term: BatchTerm, tier_term: TierTerm, *,
                 table: Sequence[Sequence[float]] | None = None, platform: str = "unknown", width: int | None = None,
                 fit_report: FitReport | None = None):
        super().__init__(platform=platform, width=width, fit_report=fit_report)
        set_bias_and_batch_term(self, bias, batch_term)
        check_type("tier_term", tier_term, TierTerm)
        self.tiers, self.phi = tier_term.tiers, tier_term.phi
        self.table: tuple[tuple[float, ...], ...] | None = None
        grid = [[self.bias + a + p for p in self.phi] for a in self.alpha]
        if table is not None:
            rows = list(table)
            if len(rows) != len(self.batch_probes):
                raise ValueError(f"table needs one row per batch probe ({len(self.batch_probes)}), got {len(rows)}")
            self.table = tuple(check_values(f"table[{i}]", r, len(self.tiers), False) for i, r in enumerate(rows))
            grid = [list(r) for r in self.table]
        _check_reachable_positive(self.batch_probes, self.tiers, grid, self.width)
        self._rows_by_batch: dict[int, Tensor] = {}  # B -> seconds per row count (`_dense_rows`)

    def _dense_rows(self, num_requests: int) -> tuple[Tensor, float]:
        """Seconds for M = 0 .. largest tier + 1 at this B (+inf past the largest tier), built once per B:
        the planner's budget curve is then one numpy gather per step instead of a per-tier interpolation."""
        table = self._rows_by_batch.get(num_requests)
        if table is None:
            rows = torch.arange(self.tiers[-1] + 2, dtype=torch.float64)
            table = self._rows_by_batch[num_requests] = self.step_seconds(num_requests, rows).cpu()
        return table, 0.0

    def _tables(self) -> tuple[Sequence[float], ...]:
        dense = [v for r in self.table for v in r] if self.table is not None else []
        return self.batch_probes, self.alpha, self.tiers, self.phi, dense

    def _seconds(self, num_requests: int, rows: Tensor, tables: tuple[Tensor, ...]) -> Tensor:
        bp, alpha, tiers, phi, dense = tables
        idx = tier_index(rows, tiers)
        b = torch.full((1,), float(num_requests), dtype=torch.float64, device=rows.device)
        if self.table is None:
            per_tier = self.bias + interp(bp, alpha, b) + phi
        else:
            grid = dense.reshape(bp.numel(), tiers.numel())
            per_tier = torch.stack([interp(bp, grid[:, j], b) for j in range(tiers.numel())]).reshape(-1)
        inf = torch.full((1,), torch.inf, dtype=torch.float64, device=rows.device)
        return torch.cat([per_tier, inf]).index_select(0, idx.reshape(-1)).reshape(rows.shape)

    def tier_of(self, rows: int) -> int | None:
        """The tier a step with this many rows replays (None past the largest)."""
        idx = int(tier_index(torch.tensor([float(rows)], dtype=torch.float64),
                             torch.tensor(self.tiers, dtype=torch.float64)))
        return self.tiers[idx] if idx < len(self.tiers) else None

    def _payload(self) -> dict[str, Any]:
        d: dict[str, Any] = {"bias": self.bias, "batch_probes": list(self.batch_probes), "alpha": list(self.alpha),
                             "tiers": list(self.tiers), "phi": list(self.phi)}
        if self.table is not None:
            d["table"] = [list(r) for r in self.table]
        return d

    @classmethod
    def _from_payload(cls, d: dict[str, Any], **common: Any) -> "TieredCostModel":
        return cls(d["bias"], BatchTerm(d["batch_probes"], d["alpha"]), TierTerm(d["tiers"], d["phi"]),
                   table=d.get("table"), **common)

    @classmethod
    def fit(cls, samples: Sequence[ProfileSample], *, tiers: Sequence[int], dense: bool = False,
            platform: str = "unknown", width: int | None = None) -> tuple["TieredCostModel", FitReport]:
        """Least squares over one-hot batch probes and tiers (each sample at the tier its rows replay).

        Every tier needs samples, none may lie past the largest tier, and the design must be connected
        (every batch probe linked to every tier through shared samples) and of full rank; otherwise the
        split between alpha and phi is arbitrary and the fit is refused. dense=True also stores the
        median of every measured (batch probe, tier) cell as the lookup table (others: the additive value).
        The report's extras hold the relative error at tier-2 .. tier+2 (`tier_edge_error`).
        """
        samples = check_samples(samples)
        tiers = check_probes("tiers", tiers, 1)
        tier_t = torch.tensor(tiers, dtype=torch.float64)
        idx = tier_index(torch.tensor([float(s.rows) for s in samples], dtype=torch.float64), tier_t).tolist()
        beyond = sorted({s.rows for s, i in zip(samples, idx) if i == len(tiers)})
        if beyond:
            raise ValueError(f"samples with rows {beyond} lie past the largest tier {tiers[-1]} (eager steps); "
                             "drop them or capture a larger tier")
        pairs = [(s.num_requests, tiers[i]) for s, i in zip(samples, idx)]
        missing = sorted(set(tiers) - {t for _, t in pairs})
        if missing:
            raise ValueError(f"tiers {missing} have no samples; the model needs one measured value per tier")
        comps = _components(pairs)
        if len(comps) > 1:
            desc = "; ".join(f"B {bs} only with tiers {ts}" for bs, ts in comps)
            raise ValueError(f"disconnected design ({len(comps)} groups: {desc}): alpha(B) and phi(tier) "
                             "cannot be separated; add samples that link the groups")
        batch_probes = sorted({b for b, _ in pairs})
        bcol = {b: 1 + i for i, b in enumerate(batch_probes[1:])}
        tcol = {t: len(bcol) + i for i, t in enumerate(tiers[1:], start=1)}
        x = torch.zeros(len(samples), 1 + len(bcol) + len(tcol), dtype=torch.float64)
        x[:, 0] = 1.0
        for i, (b, t) in enumerate(pairs):
            if b in bcol:
                x[i, bcol[b]] = 1.0
            if t in tcol:
                x[i, tcol[t]] = 1.0
        rank = require_full_rank(x, f"bias + {len(bcol)} batch + {len(tcol)} tier levels",
                                  "add samples that pair each batch probe with more tiers")
        y = torch.tensor([s.seconds for s in samples], dtype=torch.float64)
        coef = torch.linalg.lstsq(x, y.unsqueeze(1), driver="gelsd").solution.squeeze(1).tolist()
        alpha = [0.0] + coef[1:1 + len(bcol)]
        phi = [0.0] + coef[1 + len(bcol):]
        terms = BatchTerm(batch_probes, alpha), TierTerm(tiers, phi)
        model = cls(coef[0], *terms, platform=platform, width=width)
        if dense:
            model = cls(coef[0], *terms, table=_cell_medians(model, samples, pairs), platform=platform, width=width)
        report = FitReport.from_predictions(
            y.tolist(), [model.step_seconds(s.num_requests, s.rows) for s in samples],
            extras={"rank": rank, "dense": dense, "tier_edge_error": tier_edge_errors(model, samples, tiers)},
        )
        model.fit_report = report
        return model, report


def _check_reachable_positive(batch_probes: Sequence[int], tiers: Sequence[int],
                              grid: Sequence[Sequence[float]], width: int | None) -> None:
    """Step time must be > 0 wherever a step can land. B requests verify B .. B*W rows, so they replay
    tier t only if t >= B and the tier below t is < B*W. Probe i serves every B in its interpolation
    interval (the neighbouring probes; the end probes also serve every B beyond them), so it matters at
    the tiers some B of that interval can replay. A fit may leave unreachable corners <= 0."""
    for i, b in enumerate(batch_probes):
        lo = batch_probes[i - 1] + 1 if i else 1
        hi = batch_probes[i + 1] * width if width is not None and i + 1 < len(batch_probes) else None
        for j, (t, v) in enumerate(zip(tiers, grid[i])):
            below = tiers[j - 1] if j else 0
            if t >= lo and (hi is None or below < hi) and not v > 0:
                raise ValueError(f"predicted step time at B={b}, tier {t} is {v!r}; it must be > 0 wherever "
                                 f"a step can land (tier >= B, tier below < B*W)")


def _cell_medians(model: TieredCostModel, samples: Sequence[ProfileSample],
                  pairs: Sequence[tuple[int, int]]) -> list[list[float]]:
    """Median seconds of each measured (batch probe, tier) cell; cells never measured (for example a
    tier below B's floor rows) take the additive prediction bias + alpha(B) + phi(tier)."""
    cells: dict[tuple[int, int], list[float]] = {}
    for s, key in zip(samples, pairs):
        cells.setdefault(key, []).append(s.seconds)
    return [[float(torch.tensor(cells[(b, t)], dtype=torch.float64).median()) if (b, t) in cells
             else float(model.step_seconds(b, t)) for t in model.tiers] for b in model.batch_probes]
