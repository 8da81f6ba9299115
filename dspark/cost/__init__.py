"""Step-cost models T(B, M): predicted seconds of one verify step with B requests and M verify rows.

One model per module (DESIGN.md 4.6); more plug in through `register_cost_model`:

- `steps.StepsPerSecondTable`: 1-D, keyed on M only, floor lookup (the nearest probe <= M).
- `additive.AdditiveCostModel`: `T = bias + alpha(B) + theta(M)`, linear interpolation between probes.
- `tiered.TieredCostModel`: `T = bias + alpha(B) + phi(tier(M))`, keyed on the graph tier the step replays;
  `serving_tiers` leaves out a tier that costs more than a larger one.

Named serving cost models (`serving.ServingCost`: the price of a step from what it did, `step.StepWork`: verify
T(B, M), plain steps, per KV token, the drafter per depth, prefill; one JSON per modelled engine, `load_serving_cost` by name from graphs/cost_models/, `perturbed` copies to play reality)
are built by `shipped` from the published H100 fit, the H200 roofline of `roofline`, or this CPU's profile.

`base` holds the contract every model meets (`CostModel`, `ProfileSample`, `FitReport`, JSON io with a
schema version, the `kind` registry) and `check_cost_model`, the one rule where a table meets a run.
Fits refuse what they cannot identify (a rank-deficient design); `lsq` is their non-negative solver.
"""
from dspark.cost.additive import AdditiveCostModel, RowTerm, bin_rows
from dspark.cost.base import (
    SCHEMA_VERSION,
    BatchTerm,
    CostModel,
    FitReport,
    ProfileSample,
    register_cost_model,
)
from dspark.cost.loading import check_cost_model, load_cost_model
from dspark.cost.roofline import Accelerator, BlockDraftGeometry, Forward, LlamaGeometry
from dspark.cost.serving import BatchCurve, ServingCost, load_serving_cost, perturbed, serving_cost_names
from dspark.cost.steps import StepsPerSecondTable
from dspark.cost.tiered import TieredCostModel, TierTerm, serving_tiers, tier_edge_errors

__all__ = [
    "SCHEMA_VERSION", "Accelerator", "AdditiveCostModel", "BatchCurve", "BatchTerm", "BlockDraftGeometry", "CostModel",
    "FitReport", "Forward", "LlamaGeometry", "ProfileSample", "RowTerm", "ServingCost", "StepsPerSecondTable",
    "TierTerm", "TieredCostModel", "bin_rows",
    "check_cost_model", "load_cost_model", "load_serving_cost", "perturbed", "register_cost_model",
    "serving_cost_names", "serving_tiers", "tier_edge_errors",
]
