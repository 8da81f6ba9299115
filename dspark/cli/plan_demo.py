"""Planner demonstration on a built-in example: budget decision table, tau/T/theta plot, JSON.

The confidence logits are synthetic and the cost table is ILLUSTRATIVE (hand-written numbers shaped
like a graph-tier cost curve, not a measurement of any machine). The demo runs the real planner for
two steps on the same requests so that the second step's budget comes from lagged survival.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark.config import ScheduleConfig
from dspark.cost import AdditiveCostModel, BatchTerm, RowTerm
from dspark.plan.allocate import allocate_verify_lens
from dspark.plan.budget import BudgetDecision, expected_commit
from dspark.plan.planner import PlannerSettings, VerifyPlan, VerifyPlanner
from dspark.util.fileio import atomic_write, atomic_write_text
from dspark.util.options import usable_device
from dspark.util.validate import check_output_path

GAMMA = 7
NUM_REQUESTS = 12
TIERS = (16, 32, 48, 64, 96)


def illustrative_cost_model() -> AdditiveCostModel:
    """ILLUSTRATIVE step-cost table (made-up milliseconds with a cliff past 64 rows), not measured."""
    return AdditiveCostModel(
        bias=4.0e-3,
        batch_term=BatchTerm(batch_probes=[1, 16, 64], alpha=[0.0, 0.4e-3, 1.6e-3]),
        row_term=RowTerm(row_probes=[0, 32, 64, 65, 96], theta=[0.0, 0.6e-3, 2.2e-3, 3.8e-3, 5.0e-3]),
        platform="unknown",  # made up, not measured: no platform to check
        width=GAMMA + 1,
    )


def example_logits(device: torch.device) -> torch.Tensor:
    """Synthetic confidence logits [12, 7]: easy requests first, confidence decaying along drafts."""
    ease = torch.linspace(3.5, -1.5, NUM_REQUESTS, dtype=torch.float32).unsqueeze(1)
    decay = torch.linspace(0.0, 1.2, GAMMA, dtype=torch.float32).unsqueeze(0)
    wobble = 0.3 * torch.sin(torch.arange(NUM_REQUESTS * GAMMA, dtype=torch.float32)).reshape(NUM_REQUESTS, GAMMA)
    return (ease - decay + wobble).to(device)


def _curves(decision: BudgetDecision) -> dict[str, list]:
    """The decision's curves over b = 0..#candidates (the budgets that add a candidate), as lists."""
    n = int(decision.num_candidates) + 1
    return {name: getattr(decision, name)[:n].tolist()
            for name in ("rows_curve", "tau_curve", "step_seconds_curve", "theta_curve")}


def _table(decision: BudgetDecision, executed: int) -> str:
    """Every 8th budget plus the chosen and executed ones."""
    lines = [f"{'b':>4} {'rows':>5} {'tau(b)':>8} {'T(b) ms':>8} {'theta tok/s':>12}"]
    chosen = int(decision.budget)
    for b, (rows, tau, sec, theta) in enumerate(zip(*_curves(decision).values())):
        if b % 8 and b not in (chosen, executed):
            continue
        mark = {chosen: "  <- argmax", executed: "  <- after tier fill"}.get(b, "")
        lines.append(f"{b:>4} {rows:>5} {tau:>8.3f} {sec * 1e3:>8.3f} {theta:>12.1f}{mark}")
    return "\n".join(lines)


def _plot(decision: BudgetDecision, plan: VerifyPlan, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no PNG was written; install it with: pip install 'dspark[plot]'")
        return False
    curves, chosen = _curves(decision), int(decision.budget)
    b = list(range(len(curves["tau_curve"])))
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    series = [(curves["tau_curve"], "tau(b): expected committed tokens"),
              ([t * 1e3 for t in curves["step_seconds_curve"]], "T(B, B*F+b): step ms (ILLUSTRATIVE table)"),
              (curves["theta_curve"], "theta(b) = tau / T: tokens per second")]
    for ax, (y, label) in zip(axes, series):
        ax.plot(b, y, marker=".")
        ax.axvline(chosen, color="tab:red", linestyle="--", label=f"argmax b = {chosen}")
        ax.axvline(plan.budget, color="tab:green", linestyle=":", label=f"after tier fill b = {plan.budget}")
        ax.set_ylabel(label, fontsize=8)
        ax.legend(fontsize=8)
    axes[-1].set_xlabel("extra verify rows b")
    fig.suptitle(f"dspark planner demo: B={NUM_REQUESTS}, gamma={GAMMA} (synthetic logits, illustrative cost)")
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=110))
    plt.close(fig)
    return True


def run(device: str = "cpu", out: str = "plan_demo_out") -> int:
    """Run the demonstration; print the decision table; write planner_demo.{json,png} under `out`."""
    out_dir = check_output_path("out", out, folder=True)
    dev = usable_device(device)
    cfg = ScheduleConfig(gamma=GAMMA)
    cost = illustrative_cost_model()
    planner = VerifyPlanner(cfg, cost, PlannerSettings(lag=1, num_slots=NUM_REQUESTS, tiers=TIERS), device=dev)
    logits = example_logits(dev)
    slots = torch.arange(NUM_REQUESTS)
    gens = torch.zeros(NUM_REQUESTS, dtype=torch.int64)
    planner.plan(logits, slots, gens)
    plan = planner.plan(logits, slots, gens)
    decision = plan.decision
    no_fill = allocate_verify_lens(plan.survival, decision.budget, cfg)
    print("dspark planner demo: synthetic confidence logits, ILLUSTRATIVE cost table (not measured)")
    print(_table(decision, plan.budget))
    print(f"chosen budget b = {int(decision.budget)} (rows {int(decision.rows)}, tau {float(decision.tau):.3f}, "
          f"theta {float(decision.theta):.1f} tok/s)")
    print(f"verify_lens (argmax budget)   = {no_fill.tolist()}  expected commit "
          f"{float(expected_commit(plan.survival, no_fill, cfg)):.3f}")
    print(f"verify_lens (after tier fill) = {plan.verify_lens.tolist()}  expected commit "
          f"{float(expected_commit(plan.survival, plan.verify_lens, cfg)):.3f}  tier {plan.layout.tier} "
          f"({plan.layout.total_rows} real rows + {plan.layout.num_padding_rows} padding)")
    record = {
        "note": "synthetic logits; ILLUSTRATIVE cost table, not measured",
        "config": {"gamma": GAMMA, "num_requests": NUM_REQUESTS, "tiers": list(TIERS)},
        "cost_model": cost.to_dict(),
        "budget": int(decision.budget), "rows": int(decision.rows), "tau": float(decision.tau),
        "step_seconds": float(decision.step_seconds), "theta": float(decision.theta),
        **{k: v for k, v in _curves(decision).items() if k != "rows_curve"},
        "verify_lens_argmax": no_fill.tolist(), "verify_lens_tier_fill": plan.verify_lens.tolist(),
        "executed_budget": plan.budget, "tier": plan.layout.tier,
    }
    atomic_write_text(out_dir / "planner_demo.json", json.dumps(record, indent=2) + "\n")
    wrote_png = _plot(decision, plan, out_dir / "planner_demo.png")
    print(f"wrote {out_dir / 'planner_demo.json'}" + (f" and {out_dir / 'planner_demo.png'}" if wrote_png else ""))
    return 0
