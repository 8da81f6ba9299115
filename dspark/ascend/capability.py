"""Which NPU configurations may replay ragged (compact) verify graphs, and the mode decision.

An NPU configuration is admitted to compact verify only after its eager and graph equivalence checks
passed (bring-up ladder steps 1 and 2, docs/ascend.md) and were recorded here. Anything else falls back to
static verify with a logged reason, as the static 910C recipes do.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dspark.config import VerifyMode
from dspark.util.fileio import atomic_write_text, read_json

log = logging.getLogger(__name__)

SCHEMA = "dspark.npu_ragged_verify_capability"
VERSION = 1


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

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "version": VERSION, "records": [
            {"config": asdict(c), "eager_passed": e, "graph_passed": g, "detail": d}
            for c, (e, g, d) in self.records.items()]}

    @classmethod
    def from_json(cls, obj: object) -> "RaggedGraphCapability":
        """Parse `to_json` output; a wrong schema, version or record shape is a ValueError."""
        if not isinstance(obj, dict) or obj.get("schema") != SCHEMA or obj.get("version") != VERSION:
            raise ValueError(f"not a {SCHEMA} v{VERSION} document: {str(obj)[:120]!r}")
        out = cls()
        for rec in obj.get("records", []):
            try:
                cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in rec["config"].items()}
                out.record(NpuVerifyConfig(**cfg), eager_passed=rec["eager_passed"] is True,
                           graph_passed=rec["graph_passed"] is True, detail=str(rec.get("detail", "")))
            except (KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"bad capability record {rec!r}: {exc}") from exc
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write the records as JSON (atomically)."""
        return atomic_write_text(path, json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RaggedGraphCapability":
        return cls.from_json(read_json(path))


def choose_npu_verify_mode(requested_mode: VerifyMode | str, capability: CapabilityStatus) -> tuple[VerifyMode, str]:
    """The verify mode an NPU step runs, and why. Static and cap-accept keep the fixed-width geometry
    the static NPU metadata supports; compact needs a verified configuration, else static (logged)."""
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
