"""The module chain of one `VerifyPlanner.plan` call (issue 15): every dspark call and return, in order,
consecutive repeats collapsed; prints the distinct modules, the returns to a module already left (every
call returns to its caller, so this counts each helper call twice), and the upstream returns: a pipeline
stage (survival -> budget -> allocate -> layout) calling back into an earlier one.

  PYTHONPATH=. python perf/plan_call_chain.py
"""
import sys

import torch

import dspark

STAGES = ["dspark.plan.survival", "dspark.plan.budget", "dspark.plan.allocate", "dspark.verify.layout"]
cfg = dspark.ScheduleConfig(gamma=4)
cost = dspark.AdditiveCostModel(1e-3, dspark.BatchTerm([1, 8], [0.0, 1e-4]), dspark.RowTerm([1, 40], [0.0, 1e-3]),
                                width=5, platform="unknown")
for lag in (0, 1):
    planner = dspark.VerifyPlanner(cfg, cost, dspark.PlannerSettings(lag=lag, num_slots=8))
    logits = torch.randn(8, 4)
    slots, gens = torch.arange(8), torch.ones(8, dtype=torch.int64)
    planner.plan(logits, slots, gens)  # warm (first-call checks)
    seq = []

    def prof(frame, event, arg):
        mod = frame.f_globals.get("__name__", "")
        if event in ("call", "return") and mod.startswith("dspark"):
            cur = mod if event == "call" else (frame.f_back.f_globals.get("__name__", "") if frame.f_back else "")
            if cur.startswith("dspark") and (not seq or seq[-1] != cur):
                seq.append(cur)
    sys.setprofile(prof)
    planner.plan(logits, slots, gens)
    sys.setprofile(None)
    seen, returns = set(), 0
    for i, m in enumerate(seq):
        if m in seen and i > 0:
            returns += 1
        seen.add(m)
    stages = [m for m in seq if m in STAGES]
    upstream = sum(STAGES.index(b) < STAGES.index(a) for a, b in zip(stages, stages[1:]))
    print(f"lag={lag}: {len(seen)} modules, {returns} returns to a module already left, {upstream} upstream "
          f"returns between pipeline stages")
    print("  " + " -> ".join(m.replace("dspark.", "") for m in seq))
