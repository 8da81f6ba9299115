"""Schedule configuration and verify modes, validated at construction."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class VerifyMode(str, enum.Enum):
    """How the target's verify forward is laid out (DESIGN.md section 2)."""

    STATIC = "static"
    CAP_ACCEPT = "cap-accept"
    COMPACT = "compact"

    @classmethod
    def parse(cls, value: "VerifyMode | str") -> "VerifyMode":
        """Accept an enum member or its string name; name the valid choices otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown verify mode {value!r}; choose one of: {choices}") from None


@dataclass(frozen=True)
class ScheduleConfig:
    """Per-decision verify constraints.

    gamma: drafts per request; min_verify_len / max_verify_len: bounds on rows per request (root
    included), 0 <= min <= max <= gamma + 1; survival_eps: candidates below it are never verified.
    """

    gamma: int
    min_verify_len: int = 1
    max_verify_len: int | None = None
    survival_eps: float = 1e-6

    def __post_init__(self) -> None:
        _check_int("gamma", self.gamma, 1)
        _check_int("min_verify_len", self.min_verify_len, 0)
        if self.min_verify_len > self.width:
            raise ValueError(
                f"min_verify_len must be <= gamma + 1 = {self.width}, got {self.min_verify_len}"
            )
        if self.max_verify_len is not None:
            _check_int("max_verify_len", self.max_verify_len, 1)
            if self.max_verify_len > self.width:
                raise ValueError(
                    f"max_verify_len must be <= gamma + 1 = {self.width}, got {self.max_verify_len}"
                )
            if self.max_verify_len < self.floor:
                raise ValueError(
                    f"max_verify_len={self.max_verify_len} is below the floor "
                    f"max(min_verify_len, 1) = {self.floor}"
                )
        eps = self.survival_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"survival_eps must be a float, got {eps!r}")
        if not math.isfinite(eps) or eps < 0:
            raise ValueError(f"survival_eps must be finite and >= 0, got {eps}")

    @property
    def width(self) -> int:
        """W = gamma + 1: the static verify width (root + all drafts)."""
        return self.gamma + 1

    @property
    def floor(self) -> int:
        """F = max(min_verify_len, 1): rows every request verifies."""
        return max(self.min_verify_len, 1)

    @property
    def cap(self) -> int:
        """M_max = max_verify_len or W: the most rows one request may verify."""
        return self.width if self.max_verify_len is None else self.max_verify_len

    @property
    def num_candidate_columns(self) -> int:
        """Draft columns j in [F - 1, M_max - 2] that compete for the budget."""
        return self.cap - self.floor
