"""dspark: speculative decoding that verifies only what is worth verifying.

The public API, re-exported flat (DESIGN.md section 4b).
"""
from dspark.attention import RaggedVerifyAttention, verify_attention, write_kv
from dspark.config import ScheduleConfig, VerifyMode
from dspark.layout import RaggedVerifyLayout
from dspark.survival import SurvivalLagRing, calibrated_survival, monotone_survival

__all__ = [
    "RaggedVerifyAttention",
    "RaggedVerifyLayout",
    "ScheduleConfig",
    "SurvivalLagRing",
    "VerifyMode",
    "calibrated_survival",
    "monotone_survival",
    "verify_attention",
    "write_kv",
]
__version__ = "0.1.0"
