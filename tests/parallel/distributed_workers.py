"""Per-rank scenario code for tests/parallel/test_distributed.py (run in spawned gloo processes).

Kept out of the test module so the workers import only torch and dspark. Each scenario runs many steps
per launch and returns plain data; the test process makes the cross-rank assertions.
"""
from __future__ import annotations

import hashlib
import time

import torch
import torch.distributed as dist

from dspark.calibration.online import OnlineAcceptanceEstimator, draft_features
from dspark.config import ScheduleConfig
from dspark.cost import StepsPerSecondTable
from dspark.parallel import (
    AgreementError,
    CostTableMismatchError,
    DpTierAgreement,
    ParallelConfig,
    PlanningConfigMismatchError,
    TpAgreement,
    TpDisagreementError,
)
from dspark.plan.planner import PlannerSettings, VerifyPlanner
from dspark.plan.survival import calibrated_survival
from dspark.verify.layout import RaggedVerifyLayout

GAMMA = 7
WIDTH = GAMMA + 1
TIERS = (8, 16, 32)
SLOTS = 8


def replicated_lens(seed: int) -> torch.Tensor:
    """verify_lens from inputs every TP rank holds identically (same seed): survival, then lens."""
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 17, (1,), generator=g))
    logits = torch.randn(b, GAMMA, generator=g) * 3
    threshold = torch.rand((), generator=g)
    s = calibrated_survival(logits)
    return (1 + (s > threshold).sum(dim=1)).to(torch.int32)


def tp_steps(rank: int, group: dist.ProcessGroup, steps: int, mode: str) -> dict:
    """Agreed lens every step; in broadcast mode non-first ranks start from different lens (same B)."""
    tp = TpAgreement(group, mode)
    local, agreed = [], []
    for step in range(steps):
        lens = replicated_lens(step)
        if mode == "broadcast" and rank:
            lens = (lens + rank) % WIDTH + 1
        local.append(lens.tolist())
        agreed.append(tp.agree(lens).tolist())
    return {"local": local, "agreed": agreed}


def tp_injected(rank: int, world: int, group: dist.ProcessGroup, steps: int, inject: dict[int, str],
                mode: str = "verify") -> list:
    """Run `steps` steps; at step k the last rank corrupts its lens: `value` (one entry), `batch` (one
    request more or fewer) or `type` (a list, not a tensor). Returns (step, message, ranks) per error and
    the agreed lens of the clean steps (the collectives stay in step after an error)."""
    tp = TpAgreement(group, mode)
    events = []
    for step in range(steps):
        lens = replicated_lens(step)
        if rank == world - 1 and step in inject:
            lens = lens.clone()
            if inject[step] == "value":
                lens[-1] = lens[-1] % WIDTH + 1
            elif inject[step] == "batch":
                lens = lens[:-1] if lens.shape[0] > 1 else torch.cat([lens, lens])
            else:
                lens = lens.tolist()
        try:
            events.append((step, tp.agree(lens).tolist(), None))
        except TpDisagreementError as e:
            events.append((step, str(e), list(e.ranks)))
    return events


def dp_steps(rank: int, world: int, group: dist.ProcessGroup, steps: int) -> list:
    """Different batch sizes per DP rank, the last rank idle every step, plus a mock collective forward."""
    dp = DpTierAgreement(group, TIERS, SLOTS, WIDTH)
    g = torch.Generator().manual_seed(7919 * (rank + 1))
    out = []
    for _ in range(steps):
        b = 0 if rank == world - 1 else int(torch.randint(0, SLOTS, (1,), generator=g))
        lens = torch.randint(1, WIDTH + 1, (b,), generator=g, dtype=torch.int32)
        layout, dec = dp.step(lens)
        rows = layout.graph_num_tokens
        forward = None
        if dec.tier is not None:  # a replayed graph: every DP rank's tensor must have the same shape
            x = torch.full((rows, 4), float(rank + 1))
            dist.all_reduce(x, group=group)
            forward = float(x[0, 0]) if rows else None
        out.append({
            "lens": lens.tolist(), "tier": dec.tier, "requests": dec.requests, "rows": dec.rows,
            "eager": dec.eager_reason, "idle": dec.idle_ranks, "forward": forward,
            "layout": layout_summary(layout),
        })
    return out


def layout_summary(layout: RaggedVerifyLayout) -> dict:
    """The layout as plain lists (crosses the process boundary; checked by the test process)."""
    return {
        "requests": layout.num_requests, "total": layout.total_rows, "graph": layout.graph_num_tokens,
        "tier": layout.tier, "slot_lens": layout.slot_lens.tolist(), "slot_qo": layout.slot_qo_indptr.tolist(),
        "seqused": layout.seqused.tolist(), "row_slot": layout.row_slot.tolist(),
        "row_within": layout.row_within.tolist(), "qo": layout.qo_indptr.tolist(), "width": layout.width,
        "eager": layout.eager_reason, "lens": layout.verify_lens.tolist(),
    }


def cost_tables() -> tuple[StepsPerSecondTable, StepsPerSecondTable]:
    """The group's table and a 'restarted' rank's table that differs in one value."""
    rows = [1, 8, 16, 32, 64]
    return (StepsPerSecondTable(rows, [100.0, 90.0, 80.0, 60.0, 40.0], width=WIDTH),
            StepsPerSecondTable(rows, [100.0, 90.0, 80.0, 61.0, 40.0], width=WIDTH))


def cost_table(rank: int, world: int, group: dist.ProcessGroup) -> dict:
    """Same table on every rank starts; then the last rank restarts with another table and is refused."""
    same, other = cost_tables()
    parallel = ParallelConfig(tp_group=group, dp_group=group)
    VerifyPlanner(ScheduleConfig(gamma=GAMMA), same, PlannerSettings(tiers=TIERS, graph_slots=SLOTS), parallel=parallel)
    try:
        VerifyPlanner(ScheduleConfig(gamma=GAMMA), other if rank == world - 1 else same,
                      PlannerSettings(tiers=TIERS, graph_slots=SLOTS), parallel=parallel)
    except CostTableMismatchError as e:
        return {"message": str(e), "ranks": list(e.ranks)}
    return {"message": None, "ranks": []}


PLANNING_CHANGES = {  # one planning setting the last rank changes -> VerifyPlanner / PlannerSettings keywords
    "schedule": {"cfg": ScheduleConfig(gamma=GAMMA, min_verify_len=2)},
    "tiers": {"tiers": [t * 2 for t in TIERS]},
    "graph_slots": {"graph_slots": SLOTS + 1},
    "temperatures": {"temperatures": [1.0] * (GAMMA - 1) + [1.5]},
    "lag": {"lag": 2},
    "num_slots": {"num_slots": 32},
}


def planning_config(rank: int, world: int, group: dist.ProcessGroup) -> dict:
    """For each of `PLANNING_CHANGES` the last rank builds its planner with that one setting changed, over the
    same cost table: every rank's error (message, differing ranks), or None when none was raised."""
    out = {}
    for name, change in PLANNING_CHANGES.items():
        kwargs = {"cfg": ScheduleConfig(gamma=GAMMA), "tiers": TIERS, "graph_slots": SLOTS, "lag": 1,
                  "num_slots": 16, "temperatures": [1.0] * GAMMA}
        if rank == world - 1:
            kwargs |= change
        planning = PlannerSettings(**{k: kwargs.pop(k) for k in ("tiers", "graph_slots", "lag", "num_slots")})
        try:
            VerifyPlanner(kwargs.pop("cfg"), cost_tables()[0], planning, **kwargs,
                          parallel=ParallelConfig(tp_group=group, dp_group=group))
            out[name] = None
        except PlanningConfigMismatchError as e:
            out[name] = {"message": str(e), "ranks": list(e.ranks)}
    return out


def planner_inputs(replica: int, step: int, num_slots: int) -> tuple[torch.Tensor, ...]:
    """Logits, slots, generations of one DP replica (identical on its TP ranks); replica 1 idles often."""
    g = torch.Generator().manual_seed(10_007 * replica + step)
    b = 0 if replica == 1 and step % 3 == 0 else int(torch.randint(1, SLOTS, (1,), generator=g))
    logits = torch.randn(b, GAMMA, generator=g) * 3
    slots = torch.randperm(num_slots, generator=g)[:b]
    generations = torch.randint(0, 2, (b,), generator=g)
    return logits, slots, generations


def planner_steps(rank: int, world: int, group: dist.ProcessGroup, tp_pairs: list, steps: int) -> list:
    """VerifyPlanner with parallel=: TP pairs (verify mode for 4 ranks, broadcast for 2), DP over `group`."""
    replica = rank // 2
    parallel = ParallelConfig(tp_group=tp_pairs[replica], dp_group=group,
                              tp_mode="verify" if world > 2 else "broadcast")
    planner = VerifyPlanner(ScheduleConfig(gamma=GAMMA), cost_tables()[0],
                            PlannerSettings(lag=1, num_slots=16, tiers=TIERS, graph_slots=SLOTS), parallel=parallel)
    out = []
    for step in range(steps):
        plan = planner.plan(*planner_inputs(replica, step, 16))
        out.append({"lens": plan.verify_lens.tolist(), "tier": plan.dp.tier, "rows": plan.dp.rows,
                    "layout": layout_summary(plan.layout)})
    return out


EST = {"refit_every": 8, "window": 512, "min_labels": 16}  # estimator arguments of the TP scenarios
VOCAB = 48


def estimator_inputs(step: int) -> tuple[torch.Tensor, ...]:
    """One TP replica's step, identical on its ranks: draft logits [B, GAMMA, VOCAB], slots, generations, and
    the step's accept rule (uniforms compared with a true acceptance that depends on the draft features)."""
    g = torch.Generator().manual_seed(50_021 + step)
    b = int(torch.randint(1, SLOTS + 1, (1,), generator=g))
    logits = torch.randn(b, GAMMA, VOCAB, generator=g) * (0.5 + 6 * torch.rand(b, GAMMA, 1, generator=g))
    slots = torch.randperm(16, generator=g)[:b]
    generations = torch.randint(0, 3, (b,), generator=g)
    return logits, slots, generations, torch.rand(b, GAMMA, generator=g)


def accepted_drafts(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """correct_lens [B] of the synthetic target: draft k accepted with probability sigmoid(1.2 x - 0.5)."""
    c = torch.sigmoid(1.2 * draft_features(logits)[..., 0] - 0.5)
    return torch.cumprod((uniforms < c).to(torch.int64), dim=1).sum(1)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


def estimator_steps(rank: int, world: int, group: dist.ProcessGroup | None, steps: int, mode: str | None,
                    drift_step: int | None = None) -> list:
    """The estimator feeding a VerifyPlanner over `steps` steps. mode None: no process group (the test
    process's single-rank reference). At `drift_step` the last rank's accumulator drifts (one stored label
    flipped) as a rank's would after a lost or doubled update. Per step: survival and parameter digests,
    verify_lens, whether this rank's own fit differs from the parameters in use, and any TP error."""
    tp = None if mode is None else ParallelConfig(tp_group=group, tp_mode=mode)
    est = OnlineAcceptanceEstimator(GAMMA, parallel=tp, **EST)
    planner = VerifyPlanner(ScheduleConfig(gamma=GAMMA), cost_tables()[0], PlannerSettings(lag=1, num_slots=16),
                            parallel=None if mode is None else ParallelConfig(tp_group=group))
    out = []
    for step in range(steps):
        logits, slots, generations, uniforms = estimator_inputs(step)
        plan = planner.plan(est.confidence_logits(logits), slots, generations)
        if step == drift_step and rank == world - 1:
            est._y[0, 0] = 1.0 - est._y[0, 0]
        error = None
        try:
            est.observe(verify_lens=plan.verify_lens, correct_lens=accepted_drafts(logits, uniforms))
        except TpDisagreementError as e:
            error = (str(e), list(e.ranks))
        out.append({"survival": _digest(plan.survival), "parameters": _digest(est.parameters),
                    "lens": plan.verify_lens.tolist(), "refits": est.refits, "error": error,
                    "local_differs": not torch.equal(est.local_parameters, est.parameters)})
    return out


def estimator_config(rank: int, world: int, group: dist.ProcessGroup) -> dict:
    """The last rank builds its estimator with another refit interval: refused at construction, every rank."""
    refit = EST["refit_every"] + (rank == world - 1)
    try:
        OnlineAcceptanceEstimator(GAMMA, refit_every=refit, parallel=ParallelConfig(tp_group=group))
    except AgreementError as e:
        return {"message": str(e), "ranks": list(e.ranks)}
    return {"message": None, "ranks": []}


def hang(rank: int, world: int) -> None:
    """A rank that never returns (the launcher's timeout must kill it)."""
    time.sleep(600)


def scenarios(rank: int, world: int, steps: dict[int, dict[str, int]], inject: dict[int, str]) -> dict:
    """Every scenario for every group size in `steps`, largest first, in one launch.

    A size-n run uses ranks 0..n-1 (a sub-group when n < world); the other ranks are done and return.
    Spawning ranks costs seconds on a loaded machine, steps are cheap: one launch serves all sizes.
    """
    sizes = sorted(steps, reverse=True)
    groups = {n: dist.group.WORLD if n == world else dist.new_group(list(range(n))) for n in sizes}
    tp_pairs = [dist.new_group([i, i + 1]) for i in range(0, world, 2)]
    out = {}
    for n in sizes:
        if rank >= n:
            break
        g, k = groups[n], steps[n]
        out[n] = {
            "verify": tp_steps(rank, g, k["verify"], "verify"),
            "broadcast": tp_steps(rank, g, k["broadcast"], "broadcast"),
            "injected": tp_injected(rank, n, g, max(inject) + 3, inject),
            "broadcast_injected": tp_injected(rank, n, g, max(inject) + 3, inject, "broadcast"),
            "dp": dp_steps(rank, n, g, k["dp"]),
            "cost": cost_table(rank, n, g),
            "planning": planning_config(rank, n, g),
            "planner": planner_steps(rank, n, g, tp_pairs, k["planner"]),
            "estimator": estimator_steps(rank, n, g, k["estimator"], "verify"),
            "estimator_drift": estimator_steps(rank, n, g, k["estimator_drift"], "verify", k["drift_step"]),
            "estimator_authority": estimator_steps(rank, n, g, k["estimator_drift"], "broadcast", k["drift_step"]),
            "estimator_config": estimator_config(rank, n, g),
        }
    return out
