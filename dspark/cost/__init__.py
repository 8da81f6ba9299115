"""Step-cost models T(B, M): predicted seconds of one verify step with B requests and M verify rows.

One model per module (DESIGN.md 4.6); more plug in through `register_cost_model`:

- `steps.StepsPerSecondTable`: 1-D, keyed on M only, floor lookup (the nearest probe <= M).
- `additive.AdditiveCostModel`: `T = bias + alpha(B) + theta(M)`, linear interpolation between probes.
- `tiered.TieredCostModel`: `T = bias + alpha(B) + phi(tier(M))`, keyed on the graph tier the step replays;
  `serving_tiers` leaves out a tier that costs more than a larger one.

`base` holds the contract every model meets (`CostModel`, `ProfileSample`, `FitReport`, JSON io with a
schema version, the `kind` registry) and `check_cost_model`, the one rule where a table meets a run.
Fits refuse what they cannot identify (a rank-deficient design); `lsq` is their non-negative solver.
"""
from dspark.cost.additive import AdditiveCostModel, bin_rows
from dspark.cost.base import (
    SCHEMA_VERSION,
    CostModel,
    FitReport,
    ProfileSample,
    check_cost_model,
    load_cost_model,
    register_cost_model,
)
from dspark.cost.steps import StepsPerSecondTable
from dspark.cost.tiered import TieredCostModel, serving_tiers, tier_edge_errors

__all__ = [
    "SCHEMA_VERSION", "AdditiveCostModel", "CostModel", "FitReport", "ProfileSample", "StepsPerSecondTable",
    "TieredCostModel", "bin_rows", "check_cost_model", "load_cost_model", "register_cost_model", "serving_tiers",
    "tier_edge_errors",
]
