"""dspark: speculative decoding that verifies only what is worth verifying.

The public API, re-exported flat (DESIGN.md section 4b).
"""
from dspark.accept import AcceptResult, accept_greedy, accept_sampling
from dspark.config import ScheduleConfig, VerifyMode
from dspark.layout import RaggedVerifyLayout
from dspark.survival import SurvivalLagRing, calibrated_survival, monotone_survival
from dspark.verify_inputs import VerifyInputs, build_verify_inputs

__all__ = [
    "AcceptResult",
    "RaggedVerifyLayout",
    "ScheduleConfig",
    "SurvivalLagRing",
    "VerifyInputs",
    "VerifyMode",
    "accept_greedy",
    "accept_sampling",
    "build_verify_inputs",
    "calibrated_survival",
    "monotone_survival",
]
__version__ = "0.1.0"
