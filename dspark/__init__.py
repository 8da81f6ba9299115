"""dspark: speculative decoding that verifies only what is worth verifying.

The public API, re-exported flat (DESIGN.md section 4b).
"""
from dspark.allocate import allocate_verify_lens
from dspark.budget import BudgetDecision, choose_budget, expected_commit, greedy_budget, tau_curve
from dspark.config import ScheduleConfig, VerifyMode
from dspark.cost import (
    AdditiveCostModel,
    CostModel,
    FitReport,
    ProfileSample,
    StepsPerSecondTable,
    load_cost_model,
    register_cost_model,
)
from dspark.layout import RaggedVerifyLayout
from dspark.planner import VerifyPlan, VerifyPlanner
from dspark.survival import SurvivalLagRing, calibrated_survival, monotone_survival

__all__ = [
    "AdditiveCostModel",
    "BudgetDecision",
    "CostModel",
    "FitReport",
    "ProfileSample",
    "RaggedVerifyLayout",
    "ScheduleConfig",
    "StepsPerSecondTable",
    "SurvivalLagRing",
    "VerifyMode",
    "VerifyPlan",
    "VerifyPlanner",
    "allocate_verify_lens",
    "calibrated_survival",
    "choose_budget",
    "expected_commit",
    "greedy_budget",
    "load_cost_model",
    "monotone_survival",
    "register_cost_model",
    "tau_curve",
]
__version__ = "0.1.0"
