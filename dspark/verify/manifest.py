"""`TierManifest`: what a `TierGraphRunner` captured (tiers, slots per tier, W, platform, model id), kept as
JSON under `graphs/` and checked against a run before its tiers are trusted."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dspark.util.fileio import read_json, write_json_atomic
from dspark.util.validate import check_int
from dspark.verify.layout import check_tiers

MANIFEST_SCHEMA = "dspark.tier_manifest"
MANIFEST_VERSION = 1
PLATFORMS = ("cpu", "cuda", "npu")


def check_capture(tiers: Sequence[int], slots: Sequence[int], width: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(tiers, slots) as tuples when they describe a capture: at least one strictly increasing tier, W = `width`
    >= 1, one slot count per tier, each >= 1 and enough slots of W rows to fill its tier; ValueError otherwise."""
    tiers = check_tiers(tiers)
    if not tiers:
        raise ValueError("a tier manifest needs at least one tier")
    check_int("width", width, 1)
    slots = tuple(slots)
    if len(slots) != len(tiers):
        raise ValueError(f"need one slot count per tier: tiers {list(tiers)}, slots {list(slots)}")
    for t, s in zip(tiers, slots):
        check_int(f"slots for tier {t}", s, 1)
        if s * width < t:
            raise ValueError(f"tier {t} cannot be filled: {s} slots x width {width} = {s * width} rows")
    return tiers, slots


@dataclass(frozen=True)
class TierManifest:
    """What was captured: tiers, slots per tier, verify width W, platform, model id (JSON under graphs/)."""

    tiers: tuple[int, ...]
    slots: tuple[int, ...]
    width: int
    platform: str
    model_id: str
    device_name: str = ""

    def __post_init__(self) -> None:
        tiers, slots = check_capture(self.tiers, self.slots, self.width)
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS}, got {self.platform!r}")
        if not isinstance(self.model_id, str) or not isinstance(self.device_name, str):
            raise TypeError(f"model_id and device_name must be str, got {self.model_id!r}, {self.device_name!r}")
        object.__setattr__(self, "tiers", tiers)
        object.__setattr__(self, "slots", slots)

    def slots_for(self, tier: int) -> int:
        return self.slots[self.tiers.index(tier)]

    def check_compatible(self, *, width: int | None = None, platform: str | None = None,
                         model_id: str | None = None) -> None:
        """Raise ValueError when this manifest was captured for another W, platform or model."""
        for field, want in (("width", width), ("platform", platform), ("model_id", model_id)):
            have = getattr(self, field)
            if want is not None and have != want:
                raise ValueError(f"tier manifest is for {field}={have!r}, but this run has {field}={want!r}")

    def to_json(self) -> dict:
        return {"schema": MANIFEST_SCHEMA, "version": MANIFEST_VERSION, "platform": self.platform,
                "device_name": self.device_name, "model_id": self.model_id, "width": self.width,
                "tiers": list(self.tiers), "slots": list(self.slots)}

    @classmethod
    def from_json(cls, obj: object) -> "TierManifest":
        if not isinstance(obj, dict):
            raise ValueError(f"a tier manifest must be a JSON object, got {type(obj).__name__}")
        if obj.get("schema") != MANIFEST_SCHEMA or obj.get("version") != MANIFEST_VERSION:
            raise ValueError(
                f"not a {MANIFEST_SCHEMA} v{MANIFEST_VERSION} file: schema={obj.get('schema')!r} "
                f"version={obj.get('version')!r}"
            )
        missing = [k for k in ("platform", "model_id", "width", "tiers", "slots") if k not in obj]
        if missing:
            raise ValueError(f"tier manifest lacks fields {missing}")
        if not isinstance(obj["tiers"], list) or not isinstance(obj["slots"], list):
            raise ValueError(f"tiers and slots must be lists, got {obj['tiers']!r}, {obj['slots']!r}")
        return cls(tiers=tuple(obj["tiers"]), slots=tuple(obj["slots"]), width=obj["width"],
                   platform=obj["platform"], model_id=obj["model_id"],
                   device_name=obj.get("device_name", ""))

    def save(self, path: str | os.PathLike) -> Path:
        return write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike, *, width: int | None = None, platform: str | None = None,
             model_id: str | None = None) -> "TierManifest":
        """Load and validate; with width/platform/model_id given, refuse a manifest made for others."""
        try:
            manifest = cls.from_json(read_json(path))
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err
        manifest.check_compatible(width=width, platform=platform, model_id=model_id)
        return manifest
