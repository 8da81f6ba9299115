"""The flat public API is pinned: `dspark.__all__` names exactly these, each importable from `dspark`, and
each defined in the stage folder DESIGN.md section 3 puts it in (a move keeps the names; a rename fails here)."""
from __future__ import annotations

import importlib

import dspark

PUBLIC = {
    "dspark.config": ["ScheduleConfig", "VerifyMode"],
    "dspark.plan": ["BudgetDecision", "PlannerSettings", "SurvivalLagRing", "VerifyPlan", "VerifyPlanner",
                    "allocate_verify_lens", "calibrated_survival", "choose_budget", "expected_commit", "greedy_budget",
                    "monotone_survival", "tau_curve"],
    "dspark.cost": ["AdditiveCostModel", "BatchTerm", "CostModel", "FitReport", "ProfileSample", "RowTerm",
                    "StepsPerSecondTable", "TierTerm", "TieredCostModel", "check_cost_model", "load_cost_model",
                    "register_cost_model"],
    "dspark.verify": ["AcceptResult", "AttentionShape", "GraphBackend", "RaggedVerifyAttention", "RaggedVerifyLayout",
                      "StepBuffers", "PagedKV", "TierSpec", "VerifyExecution",
                      "TierGraphRunner", "TierManifest", "VerifyInputs", "accept_greedy", "accept_sampling",
                      "build_verify_inputs", "verify_attention", "write_kv"],
    "dspark.calibration": ["Calibration", "ConfidenceHead", "FitOptions", "StsData", "StsOutcome", "StsRecorder",
                           "auroc", "brier", "OnlineAcceptanceEstimator", "confidence_loss", "draft_features", "ece",
                           "fit_sts", "fit_temperatures", "load_sts", "nll", "previous_tokens", "soft_accept_target",
                           "top2_margin"],
    "dspark.parallel": ["CostTableMismatchError", "DpTier", "DpTierAgreement", "ParallelConfig", "TpAgreement",
                        "TpDisagreementError", "check_cost_table"],
    "dspark.telemetry": ["StepRecord", "acceptance", "tau_bias"],
    "dspark.serve": ["BlockDrafter", "CausalLMDrafter", "Drafter", "NgramDrafter", "SpecDecoder"],
    "dspark.serve.generate": ["Generation", "generate"],
}


def test_all_names_exactly_the_pinned_set() -> None:
    pinned = sorted(n for names in PUBLIC.values() for n in names)
    assert sorted(dspark.__all__) == pinned
    assert len(pinned) == 79


def test_every_public_name_lives_in_its_stage_folder() -> None:
    for stage, names in PUBLIC.items():
        for name in names:
            obj = getattr(dspark, name)
            home = getattr(obj, "__module__", None) or ""
            assert home == stage or home.startswith(stage + "."), (name, home, stage)
            assert importlib.import_module(home) is not None
