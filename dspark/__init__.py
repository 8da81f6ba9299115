"""dspark: speculative decoding that verifies only what is worth verifying.

The public API, re-exported flat (DESIGN.md section 4b).
"""
from dspark.config import ScheduleConfig, VerifyMode
from dspark.graphs import TierGraphRunner, TierManifest
from dspark.layout import RaggedVerifyLayout
from dspark.survival import SurvivalLagRing, calibrated_survival, monotone_survival

__all__ = [
    "RaggedVerifyLayout",
    "ScheduleConfig",
    "SurvivalLagRing",
    "TierGraphRunner",
    "TierManifest",
    "VerifyMode",
    "calibrated_survival",
    "monotone_survival",
]
__version__ = "0.1.0"
