"""Which NPU configurations may replay ragged (compact) verify graphs, and the mode decision.

An NPU configuration is admitted to compact verify only after its eager and graph equivalence checks
passed (bring-up ladder steps 1 and 2, `perf/ascend_bringup.py`) and were recorded here. Anything else
falls back to static verify with a logged reason, as today's 910C recipes do.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from dspark.config import VerifyMode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NpuVerifyConfig:
    """What one pair of equivalence checks covered: the captured tiers and slots, W, ratios, device."""

    tiers: tuple[int, ...]
    slots: tuple[int, ...]
    width: int
    compress_ratios: tuple[int, ...] = (4, 128)
    device_name: str = ""


@dataclass(frozen=True)
class CapabilityStatus:
    """`supports_ragged_verify_graph` for one configuration, with the reason when False."""

    supported: bool
    reason: str


@dataclass
class RaggedGraphCapability:
    """Recorded equivalence-check outcomes per configuration (eager compact == static; replay == eager)."""

    records: dict[NpuVerifyConfig, tuple[bool, bool, str]] = field(default_factory=dict)

    def record(self, config: NpuVerifyConfig, *, eager_passed: bool, graph_passed: bool, detail: str = "") -> None:
        """Store the outcome of both checks for `config` (a later record replaces an earlier one)."""
        if not isinstance(config, NpuVerifyConfig):
            raise TypeError(f"config must be an NpuVerifyConfig, got {type(config).__name__}")
        self.records[config] = (bool(eager_passed), bool(graph_passed), detail)

    def status(self, config: NpuVerifyConfig) -> CapabilityStatus:
        """Supported only when both checks were recorded as passed for exactly this configuration."""
        if config not in self.records:
            return CapabilityStatus(False, f"no equivalence checks recorded for {config}")
        eager, graph, detail = self.records[config]
        failed = [name for name, ok in (("eager compact == static", eager), ("graph replay == eager", graph))
                  if not ok]
        if failed:
            return CapabilityStatus(False, f"{' and '.join(failed)} failed for {config}" + (f": {detail}" if detail else ""))
        return CapabilityStatus(True, f"eager and graph equivalence checks passed for {config}")

    def supports_ragged_verify_graph(self, config: NpuVerifyConfig) -> bool:
        return self.status(config).supported


def choose_npu_verify_mode(requested_mode: VerifyMode | str, capability: CapabilityStatus) -> tuple[VerifyMode, str]:
    """The verify mode an NPU step runs, and why. Static and cap-accept keep the fixed-width geometry
    today's NPU metadata supports; compact needs a verified configuration, else static (logged)."""
    mode = VerifyMode.parse(requested_mode)
    if not isinstance(capability, CapabilityStatus):
        raise TypeError(f"capability must be a CapabilityStatus, got {type(capability).__name__}")
    if mode is not VerifyMode.COMPACT:
        return mode, f"{mode.value} verify keeps the fixed-width NPU geometry"
    if capability.supported:
        return mode, capability.reason
    reason = f"compact verify falls back to static on NPU: {capability.reason}"
    log.warning(reason)
    return VerifyMode.STATIC, reason
