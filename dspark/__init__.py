"""dspark: speculative decoding that verifies only what is worth verifying.

The public API, re-exported flat (DESIGN.md section 4b). The serving entry points (`generate`, `SpecDecoder` and
the drafters) need the `models` extra (transformers): they are imported on first use, so `import dspark` stays
light.
"""
from importlib import import_module as _import_module

from dspark.calibration.confidence import (
    ConfidenceHead,
    confidence_loss,
    previous_tokens,
    soft_accept_target,
)
from dspark.calibration.fit import Calibration, FitOptions, fit_sts, fit_temperatures
from dspark.calibration.metrics import auroc, brier, ece, nll, top2_margin
from dspark.calibration.online import OnlineAcceptanceEstimator, draft_features
from dspark.calibration.recorder import StsData, StsOutcome, StsRecorder, load_sts
from dspark.config import ScheduleConfig, VerifyMode
from dspark.cost import (
    AdditiveCostModel,
    BatchTerm,
    CostModel,
    FitReport,
    ProfileSample,
    RowTerm,
    StepsPerSecondTable,
    TieredCostModel,
    TierTerm,
    check_cost_model,
    load_cost_model,
    register_cost_model,
)
from dspark.parallel import (
    CostTableMismatchError,
    DpTier,
    DpTierAgreement,
    ParallelConfig,
    TpAgreement,
    TpDisagreementError,
    check_cost_table,
)
from dspark.plan.allocate import allocate_verify_lens
from dspark.plan.budget import (
    BudgetDecision,
    choose_budget,
    expected_commit,
    greedy_budget,
    tau_curve,
)
from dspark.plan.planner import PlannerSettings, VerifyPlan, VerifyPlanner
from dspark.plan.survival import SurvivalLagRing, calibrated_survival, monotone_survival
from dspark.telemetry import StepRecord, acceptance, tau_bias
from dspark.verify.accept import AcceptResult, accept_greedy, accept_sampling
from dspark.verify.attention import AttentionShape, RaggedVerifyAttention, verify_attention
from dspark.verify.graphs import GraphBackend, StepBuffers, TierGraphRunner, TierSpec
from dspark.verify.inputs import PagedKV, VerifyExecution, VerifyInputs, build_verify_inputs
from dspark.verify.kv_write import write_kv
from dspark.verify.layout import RaggedVerifyLayout
from dspark.verify.manifest import TierManifest

_SERVING = {  # name -> module, imported on first access (PEP 562)
    "generate": "dspark.serve.generate",
    "Generation": "dspark.serve.generate",
    "SpecDecoder": "dspark.serve.engine",
    "Drafter": "dspark.serve.drafters.base",
    "BlockDrafter": "dspark.serve.drafters.block",
    "NgramDrafter": "dspark.serve.drafters.ngram",
    "CausalLMDrafter": "dspark.serve.drafters.causal_lm",
}


def __getattr__(name: str) -> object:
    if name not in _SERVING:
        raise AttributeError(f"module 'dspark' has no attribute {name!r}")
    value = getattr(_import_module(_SERVING[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SERVING))


__all__ = [
    *_SERVING,
    "StepRecord",
    "acceptance",
    "tau_bias",
    "AcceptResult",
    "AdditiveCostModel",
    "BatchTerm",
    "RowTerm",
    "TierTerm",
    "AttentionShape",
    "BudgetDecision",
    "Calibration",
    "ConfidenceHead",
    "OnlineAcceptanceEstimator",
    "draft_features",
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
    "StsOutcome",
    "auroc",
    "brier",
    "confidence_loss",
    "ece",
    "fit_sts",
    "FitOptions",
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
    "VerifyExecution",
    "PagedKV",
    "TpAgreement",
    "TpDisagreementError",
    "TierGraphRunner",
    "TierSpec",
    "TierManifest",
    "VerifyMode",
    "VerifyPlan",
    "VerifyPlanner",
    "PlannerSettings",
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
