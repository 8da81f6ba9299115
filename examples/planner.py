"""The planner API end to end on synthetic logits (README "Planner API"; run by tests/package/test_packaging.py).

    python examples/planner.py
"""
import tempfile
from pathlib import Path

import torch

import dspark

cfg = dspark.ScheduleConfig(gamma=7)                     # min_verify_len=1, max_verify_len=None, survival_eps=1e-6
# a cost model: here a made-up additive table saved and loaded again; a measured one comes from
# perf/tier_sweep.py (graphs/README.md). T = bias + alpha(B) + theta(M): alpha and theta given at their probes
alpha = dspark.BatchTerm(batch_probes=[1, 16], alpha=[0.0, 4e-4])
theta = dspark.RowTerm(row_probes=[0, 32, 64, 65, 96], theta=[0.0, 6e-4, 2.2e-3, 3.8e-3, 5e-3])
made_up = dspark.AdditiveCostModel(4e-3, alpha, theta, width=cfg.width)
cost = dspark.load_cost_model(made_up.save(Path(tempfile.mkdtemp()) / "cost.json"))

gen = torch.Generator().manual_seed(0)
logits = torch.randn(12, cfg.gamma, generator=gen) * 2 + 1  # confidence logits [B, gamma], one step
lagged_logits = torch.randn(12, cfg.gamma, generator=gen) * 2 + 1  # the previous step's
temperatures = [1.0] * cfg.gamma                         # STS temperatures (dspark.fit_sts)

s = dspark.calibrated_survival(logits, temperatures)     # [B, gamma] float32
s_lagged = dspark.calibrated_survival(lagged_logits, temperatures)
dec = dspark.choose_budget(s_lagged, cost, cfg)          # argmax_b tau(b) / T(B, B*F + b), ties to the smaller b
vl = dspark.allocate_verify_lens(s, dec.budget, cfg)     # [B] int32: global top-k (survival desc, position, request)
print("budget", int(dec.budget), "verify_lens", vl.tolist(), "tau", round(float(dspark.expected_commit(s, vl, cfg)), 3))

planner = dspark.VerifyPlanner(cfg, cost, dspark.PlannerSettings(lag=1, num_slots=256, tiers=(64, 128, 256),
                                                             graph_slots=None))
slots, generations = torch.arange(12), torch.zeros(12, dtype=torch.int64)  # request-pool slot, its generation
planner.plan(lagged_logits, slots, generations)           # step 1 (its budget reads an empty ring: all ones)
plan = planner.plan(logits, slots, generations)           # VerifyPlan(verify_lens, layout, decision, survival, ...)
print("planned", plan.verify_lens.tolist(), "budget", plan.budget, "of", plan.tier_budget, "tier", plan.layout.tier)
