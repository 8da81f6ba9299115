"""Calibration: the confidence head, the STS recorder, the temperature fit, its metrics and plots."""
