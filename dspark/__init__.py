"""dspark: speculative decoding that verifies only what is worth verifying.

The public API, re-exported flat (DESIGN.md section 4b).
"""
from dspark.calibration import Calibration, fit_sts, fit_temperatures
from dspark.calibration_metrics import auroc, brier, ece, nll, top2_margin
from dspark.calibration_recorder import StsData, StsRecorder, load_sts
from dspark.confidence import ConfidenceHead, confidence_loss, previous_tokens, soft_accept_target
from dspark.config import ScheduleConfig, VerifyMode
from dspark.layout import RaggedVerifyLayout
from dspark.survival import SurvivalLagRing, calibrated_survival, monotone_survival

__all__ = [
    "Calibration",
    "ConfidenceHead",
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
    "RaggedVerifyLayout",
    "ScheduleConfig",
    "SurvivalLagRing",
    "VerifyMode",
    "calibrated_survival",
    "monotone_survival",
]
__version__ = "0.1.0"
