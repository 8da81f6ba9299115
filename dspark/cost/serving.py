"""Named serving cost models: everything a simulated serving engine charges per step, in one JSON file.

A policy-lab run replays recorded draft traces through the engine's scheduler and policies against a simulated
target. The policy (the planner's T(B, M), Adaptive's speculate-or-not) and the simulated target read the same
`ServingCost`; a `perturbed` copy plays reality in robustness runs. A file holds:

- `speculative`: a dspark `CostModel`, T(B, M) of a whole speculative step (draft + plan + verify + accept) with
  B requests and M verify rows, for one static verify width W = gamma + 1 (the model's `width`);
- `plain`: seconds of a target-only step (one row per request) per B, what `Adaptive(plain_seconds=)` reads;
- `draft`: the draft's own part of a speculative step per B (for reports: it is already inside `speculative`);
- `tiers`: the graph tiers the modelled engine pads a step's rows to (`VerifyPlanner(tiers=)`), () for none;
- `name`, `platform` (the modelled hardware), `description`, `sources` (where each parameter comes from) and
  the generator's `parameters`.

T must be finite and > 0 at every B in 1..max_requests and M in B..B*W (checked at construction, so a file
that loads covers its range). Shipped files are graphs/cost_models/<name>.json, documented in that folder's
README and written by `python -m dspark.cost.shipped --write <name>`.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from dspark.cost.base import CostModel, check_cost_model, check_probes, check_values
from dspark.util.fileio import read_json, write_json_atomic
from dspark.util.validate import check_int, check_real, check_type

SCHEMA = "dspark.serving_cost"
SCHEMA_VERSION = 1
COST_MODELS_DIR = Path(__file__).resolve().parents[2] / "graphs" / "cost_models"

# per cost-model kind: the JSON fields holding seconds (power 1) or rates (power -1), which `perturbed` scales
_PERTURBED_FIELDS = {"additive": (("bias", 1), ("alpha", 1), ("theta", 1)),
                     "tiered": (("bias", 1), ("alpha", 1), ("phi", 1), ("table", 1)),
                     "steps_per_second": (("steps_per_second", -1),)}


@dataclass(frozen=True)
class BatchCurve:
    """Seconds of one step as a function of the batch size B: values at batch probes, linear between them."""

    batch_sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        probes = check_probes("batch_sizes", self.batch_sizes, 1)
        object.__setattr__(self, "batch_sizes", probes)
        object.__setattr__(self, "seconds", check_values("seconds", self.seconds, len(probes), True))

    def __call__(self, num_requests: int) -> float:
        """Seconds at B = num_requests, which must lie in [batch_sizes[0], batch_sizes[-1]]."""
        lo, hi = self.batch_sizes[0], self.batch_sizes[-1]
        if check_int("num_requests", num_requests, 1) < lo or num_requests > hi:
            raise ValueError(f"num_requests must be in [{lo}, {hi}] (the batch sizes this curve covers), got "
                             f"{num_requests}")
        return float(np.interp(num_requests, self.batch_sizes, self.seconds))

    def to_dict(self) -> dict[str, list]:
        """{"batch_sizes": [...], "seconds": [...]}."""
        return {"batch_sizes": list(self.batch_sizes), "seconds": list(self.seconds)}

    @classmethod
    def from_dict(cls, d: object) -> "BatchCurve":
        """Validate and rebuild from `to_dict` output."""
        if not isinstance(d, dict) or set(d) != {"batch_sizes", "seconds"}:
            raise ValueError(f"a batch curve must be a JSON object with batch_sizes and seconds, got {d!r}")
        return cls(d["batch_sizes"], d["seconds"])


@dataclass(frozen=True)
class ServingCost:
    """Step costs of one modelled serving engine: speculative T(B, M), plain and draft seconds per B.

    name: file stem of a shipped model; platform: the modelled hardware ("h100-cuda"); sources: where each
    parameter comes from; speculative: CostModel with width W = gamma + 1; plain, draft: BatchCurve over at
    least B = 1..max_requests; tiers: graph tiers the modelled engine replays (() for eager); parameters: the
    generator's arguments (JSON values).
    """

    name: str
    platform: str
    description: str
    sources: tuple[str, ...]
    speculative: CostModel
    plain: BatchCurve
    draft: BatchCurve
    tiers: tuple[int, ...] = ()
    max_requests: int = 256
    parameters: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("name", "platform"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        check_type("description", self.description, str)
        sources = tuple(check_type("sources", self.sources, (list, tuple)))
        if not sources or not all(isinstance(s, str) and s for s in sources):
            raise ValueError(f"sources must be a non-empty list of non-empty strings, got {self.sources!r}")
        object.__setattr__(self, "sources", sources)
        check_type("speculative", self.speculative, CostModel)
        if self.speculative.width is None:
            raise ValueError("speculative must record its width W = gamma + 1, got a cost model with width None")
        check_int("max_requests", self.max_requests, 1)
        for name in ("plain", "draft"):
            curve = check_type(name, getattr(self, name), BatchCurve)
            if curve.batch_sizes[0] != 1 or curve.batch_sizes[-1] < self.max_requests:
                raise ValueError(f"{name} must cover B = 1..max_requests = {self.max_requests}, got batch sizes "
                                 f"{curve.batch_sizes[0]}..{curve.batch_sizes[-1]}")
        object.__setattr__(self, "tiers", check_probes("tiers", self.tiers, 1) if self.tiers else ())
        parameters = dict(check_type("parameters", self.parameters, Mapping))
        try:
            json.dumps(parameters, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"parameters must hold JSON values (finite numbers, strings, lists), got "
                             f"{parameters!r}: {e}") from None
        object.__setattr__(self, "parameters", parameters)
        _check_coverage(self.speculative, self.max_requests)

    @property
    def width(self) -> int:
        """W = gamma + 1 of the speculative model."""
        return self.speculative.width

    def plain_seconds(self, num_requests: int) -> float:
        """Seconds of a target-only step over B = num_requests requests (in 1..max_requests)."""
        return self.plain(self._batch(num_requests))

    def draft_seconds(self, num_requests: int) -> float:
        """Seconds of the draft's part of a speculative step over B = num_requests requests (in 1..max_requests)."""
        return self.draft(self._batch(num_requests))

    def _batch(self, num_requests: int) -> int:
        if check_int("num_requests", num_requests, 1) > self.max_requests:
            raise ValueError(f"num_requests must be in [1, max_requests = {self.max_requests}], got {num_requests}")
        return num_requests

    def to_dict(self) -> dict[str, Any]:
        """The JSON object `save` writes (schema, version, every field; the cost model's own `to_dict`)."""
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "name": self.name, "platform": self.platform,
                "description": self.description, "sources": list(self.sources), "max_requests": self.max_requests,
                "tiers": list(self.tiers), "parameters": dict(self.parameters),
                "speculative": self.speculative.to_dict(), "plain_seconds": self.plain.to_dict(),
                "draft_seconds": self.draft.to_dict()}

    @classmethod
    def from_dict(cls, d: object) -> "ServingCost":
        """Validate and rebuild from `to_dict` output."""
        if not isinstance(d, dict):
            raise ValueError(f"a serving cost must be a JSON object, got {type(d).__name__}")
        if d.get("schema") != SCHEMA or d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"schema must be {SCHEMA!r} version {SCHEMA_VERSION}, got {d.get('schema')!r} version "
                             f"{d.get('schema_version')!r} (a single cost model loads with dspark.load_cost_model)")
        missing = sorted({"name", "platform", "description", "sources", "max_requests", "tiers", "parameters",
                          "speculative", "plain_seconds", "draft_seconds"} - set(d))
        if missing:
            raise ValueError(f"serving cost is missing {missing}")
        parts = {}
        for key, load in (("speculative", CostModel.from_dict), ("plain_seconds", BatchCurve.from_dict),
                          ("draft_seconds", BatchCurve.from_dict)):
            try:
                parts[key] = load(d[key])
            except (ValueError, TypeError) as e:
                raise ValueError(f"{key}: {e}") from None
        return cls(d["name"], d["platform"], d["description"], d["sources"], parts["speculative"],
                   parts["plain_seconds"], parts["draft_seconds"], tiers=d["tiers"], max_requests=d["max_requests"],
                   parameters=d["parameters"])

    def save(self, path: str | os.PathLike) -> Path:
        """Write the JSON atomically (temp file in the same folder, then rename)."""
        return write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ServingCost":
        """Read and validate a saved serving cost; every error names the file."""
        d = read_json(path)
        try:
            return cls.from_dict(d)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None


def _check_coverage(model: CostModel, max_requests: int) -> None:
    """T(B, M) finite and > 0 at every B in 1..max_requests and M in B..B*W; the first bad point is named."""
    w = model.width
    for b in range(1, max_requests + 1):
        seconds = model.seconds_curve(b, b, b * (w - 1) + 1)
        bad = ~(np.isfinite(seconds) & (seconds > 0))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"speculative predicts {float(seconds[i])!r} s at B={b}, M={b + i}; a serving cost needs "
                             f"finite seconds > 0 at every B in 1..max_requests = {max_requests} and M in B..B*W "
                             f"(W={w})")


def serving_cost_names() -> list[str]:
    """Names of the shipped serving costs (graphs/cost_models/<name>.json)."""
    return sorted(p.stem for p in COST_MODELS_DIR.glob("*.json"))


def load_serving_cost(name_or_path: str | os.PathLike, *, width: int | None = None) -> ServingCost:
    """A shipped serving cost by name, or one saved at a path; with `width`, refused unless its W equals it.

    name_or_path: a shipped name (`serving_cost_names()`) or a path to a .json file; width: the run's
    W = gamma + 1, or None to accept any.
    """
    path = Path(check_type("name_or_path", name_or_path, (str, os.PathLike)))
    if isinstance(name_or_path, str) and path.suffix != ".json" and len(path.parts) == 1:
        path = COST_MODELS_DIR / f"{name_or_path}.json"
        if not path.is_file():
            raise ValueError(f"unknown serving cost {name_or_path!r}; shipped: {serving_cost_names()} (or pass the "
                             "path of a .json file)")
    cost = ServingCost.load(path)
    if width is not None:
        try:
            check_cost_model(cost.speculative, width=check_int("width", width, 2))
        except ValueError as e:
            name = cost.name if cost.name in serving_cost_names() else "NAME"
            raise ValueError(f"{path}: {e}; or write this model for W={width}: python -m dspark.cost.shipped --write "
                             f"{name} --gamma {width - 1} --out PATH") from None
    return cost


def perturbed(cost: ServingCost, *, spread: float, seed: int, plain_skew: float = 0.0) -> ServingCost:
    """A seeded copy with every stored seconds value scaled by 1 + eps, eps ~ U(-spread, spread) drawn per value.

    spread: half-width in [0, 1) (0.05 = +-5 %); seed: int >= 0, the same seed gives the same copy; plain_skew:
    plain seconds are further scaled by 1 + plain_skew (> -1), so reality can price plain steps differently
    from speculative ones. When every stored component is >= 0 (tables of seconds) the copy's T(B, M) lies in
    [1 - spread, 1 + spread] x T(B, M), its plain seconds in that band x (1 + plain_skew).
    """
    check_type("cost", cost, ServingCost)
    spread = check_real("spread", spread, 0.0, 1.0, high_open=True)
    check_int("seed", seed, 0)
    plain_skew = check_real("plain_skew", plain_skew, -1.0, math.inf, low_open=True, high_open=True)
    spec = cost.speculative.to_dict()
    if spec["kind"] not in _PERTURBED_FIELDS:
        raise ValueError(f"perturbed scales cost model kinds {sorted(_PERTURBED_FIELDS)}, got {spec['kind']!r}")
    rng = np.random.default_rng(seed)

    def scaled(values: Any, power: int) -> Any:
        if isinstance(values, list):
            return [scaled(v, power) for v in values]
        return values * (1.0 + rng.uniform(-spread, spread)) ** power

    spec.pop("fit", None)  # the residuals of a fit describe the original, not the copy
    for key, power in _PERTURBED_FIELDS[spec["kind"]]:
        if key in spec:
            spec[key] = scaled(spec[key], power)
    plain = BatchCurve(cost.plain.batch_sizes, [s * (1.0 + plain_skew) for s in scaled(list(cost.plain.seconds), 1)])
    draft = BatchCurve(cost.draft.batch_sizes, scaled(list(cost.draft.seconds), 1))
    how = {"from": cost.name, "spread": spread, "seed": seed, "plain_skew": plain_skew}
    return ServingCost(f"{cost.name}-perturbed", cost.platform,
                       f"{cost.description} Perturbed: every stored seconds value x (1 + U(-{spread:g}, {spread:g})), "
                       f"seed {seed}; plain steps x {1 + plain_skew:g}.",
                       cost.sources + (f"perturbed({how})",), CostModel.from_dict(spec), plain, draft,
                       tiers=cost.tiers, max_requests=cost.max_requests,
                       parameters={**cost.parameters, "perturbed": how})

