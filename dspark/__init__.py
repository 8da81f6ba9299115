"""dspark: speculative decoding that verifies only what is worth verifying.

The public API, re-exported flat (DESIGN.md section 4b).
"""
from dspark.accept import AcceptResult, accept_greedy, accept_sampling
from dspark.allocate import allocate_verify_lens
from dspark.attention import RaggedVerifyAttention, verify_attention, write_kv
from dspark.budget import BudgetDecision, choose_budget, expected_commit, greedy_budget, tau_curve
from dspark.calibration import Calibration, fit_sts, fit_temperatures
from dspark.calibration_metrics import auroc, brier, ece, nll, top2_margin
from dspark.calibration_recorder import StsData, StsRecorder, load_sts
from dspark.confidence import ConfidenceHead, confidence_loss, previous_tokens, soft_accept_target
from dspark.config import ScheduleConfig, VerifyMode
from dspark.cost import (
    AdditiveCostModel,
    CostModel,
    FitReport,
    ProfileSample,
    StepsPerSecondTable,
    TieredCostModel,
    check_cost_model,
    load_cost_model,
    register_cost_model,
)
from dspark.distributed import (
    CostTableMismatchError,
    DpTier,
    DpTierAgreement,
    ParallelConfig,
    TpAgreement,
    TpDisagreementError,
    check_cost_table,
)
from dspark.graphs import GraphBackend, StepBuffers, TierGraphRunner, TierManifest
from dspark.layout import RaggedVerifyLayout
from dspark.planner import VerifyPlan, VerifyPlanner
from dspark.survival import SurvivalLagRing, calibrated_survival, monotone_survival
from dspark.telemetry import StepRecord, acceptance, tau_bias
from dspark.verify_inputs import VerifyInputs, build_verify_inputs

__all__ = [
    "StepRecord",
    "acceptance",
    "tau_bias",
    "AcceptResult",
    "AdditiveCostModel",
    "BudgetDecision",
    "Calibration",
    "ConfidenceHead",
    "CostModel",
    "CostTableMismatchError",
    "DpTier",
    "DpTierAgreement",
    "FitReport",
    "ParallelConfig",
    "GraphBackend",
    "ProfileSample",
    "StsData",
    "StsRecorder",
    "auroc",
    "brier",
    "confidence_loss",
    "ece",
    "fit_sts",
    "fit_temperatures",
    "load_sts",
    "nll",
    "previous_tokens",
    "soft_accept_target",
    "top2_margin",
    "RaggedVerifyAttention",
    "RaggedVerifyLayout",
    "ScheduleConfig",
    "StepBuffers",
    "StepsPerSecondTable",
    "TieredCostModel",
    "SurvivalLagRing",
    "VerifyInputs",
    "TpAgreement",
    "TpDisagreementError",
    "TierGraphRunner",
    "TierManifest",
    "VerifyMode",
    "VerifyPlan",
    "VerifyPlanner",
    "accept_greedy",
    "accept_sampling",
    "allocate_verify_lens",
    "build_verify_inputs",
    "calibrated_survival",
    "check_cost_table",
    "check_cost_model",
    "choose_budget",
    "expected_commit",
    "greedy_budget",
    "load_cost_model",
    "monotone_survival",
    "register_cost_model",
    "tau_curve",
    "verify_attention",
    "write_kv",
]
__version__ = "0.1.0"
