"""Parallel serving (DESIGN.md 4.10): TP `verify_lens` agreement (`tp`), the DP-global tier with idle ranks
(`dp`), the planner's view of both plus the start-up cost-table and planning-configuration checks and the
online estimator's parameters (`agreement`), and a local gloo launcher for tests and benchmarks (`launch`)."""
from dspark.parallel.agreement import (
                                     EstimatorAgreement,
                                     ParallelAgreement,
                                     check_cost_table,
                                     check_fingerprint,
                                     check_planning_config,
)
from dspark.parallel.dp import DpTier, DpTierAgreement
from dspark.parallel.tp import (
                                     TP_MODES,
                                     AgreementError,
                                     CostTableMismatchError,
                                     ParallelConfig,
                                     PlanningConfigMismatchError,
                                     TpAgreement,
                                     TpDisagreementError,
                                     verify_lens_hash,
)

__all__ = [
    "TP_MODES", "AgreementError", "CostTableMismatchError", "DpTier", "DpTierAgreement", "EstimatorAgreement",
    "ParallelAgreement", "ParallelConfig", "PlanningConfigMismatchError", "TpAgreement", "TpDisagreementError",
    "check_cost_table", "check_fingerprint", "check_planning_config", "verify_lens_hash",
]
