"""Named serving cost models: what a simulated serving engine charges for each step, from what the step did.

A policy-lab run replays recorded draft traces through the engine's scheduler and policies against a simulated
target, which charges every step `ServingCost.price(StepWork)`:

    speculative step:  verify.T(B, M) + per_kv_token x K + drafter(depth k, drafting requests, catch_up) + prefill
    plain step:        plain(B)       + per_kv_token x K + prefill

- `verify`: a dspark `CostModel` T(B, M), the target's verify forward over M rows (before tier padding: the
  model pads itself where the modelled engine has graph tiers) with the step's plan and accept, at zero KV
  context; it records W = gamma + 1 (`width`), the widest verify it covers;
- `plain`: seconds of a target-only step (one row per request) per B, at zero KV context;
- `per_kv_token`: seconds per KV token K the step's attention reads: by `kv_layout`, the tokens its requests hold
  before it (prompt + committed) summed (`ragged`) or B x the most one request holds (`padded`);
- `drafter`: `DraftCost`, the drafter's kind (`chain`, `parallel` or `ngram`) and its seconds for k drafts per
  request over n requests, k = 1..gamma (a policy that drafts k pays for k), plus seconds per token it catches up
  beyond the roots (tokens committed since its last proposal, a prompt after admission);
- `prefill`: `PrefillCost`, seconds to prefill the prompts admitted before a step (per forward + per token), or
  per token alone for prompts folded into the step's target forward (`StepWork.prefill_folded`);
- `tiers`, `name`, `platform` (the modelled hardware), `description`, `sources`, the generator's `parameters`.

What a policy *believes* (its planner's T(B, M), its plain step) is `believed(drafts, context)` /
`believed_plain(context)`: the same terms at one typical per-request context, as a server profiles them. The
exact rules, with the lab's queue and measures: docs/replay.md. Shipped files are
graphs/cost_models/<name>.json, written by `python -m dspark.lab.cost_models --write <name>`.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from dspark.cost.base import CostModel, check_probes
from dspark.cost.loading import check_cost_model
from dspark.cost.step import (
    DRAFTER_KINDS,
    KV_LAYOUTS,
    BatchCurve,
    DraftCost,
    PrefillCost,
    StepWork,
    kv_priced,
    prefill_from_dict,
)
from dspark.cost.tiered import TieredCostModel
from dspark.util.fileio import load_json_as, write_json_atomic
from dspark.util.validate import check_int, check_real, check_sha256, check_type

SCHEMA = "dspark.serving_cost"
SCHEMA_VERSION = 2
COST_MODELS_DIR = Path(__file__).resolve().parents[2] / "graphs" / "cost_models"

# per cost-model kind: the JSON fields holding seconds (power 1) or rates (power -1), which `perturbed` scales
_PERTURBED_FIELDS = {"additive": (("bias", 1), ("alpha", 1), ("theta", 1)),
                     "tiered": (("bias", 1), ("alpha", 1), ("phi", 1), ("table", 1)),
                     "steps_per_second": (("steps_per_second", -1),)}


# the fields of a schema-2 file: every one required but kv_layout (`ragged` when absent)
_REQUIRED = frozenset({"schema", "schema_version", "name", "platform", "description", "sources", "max_requests",
                       "tiers", "parameters", "verify", "plain_seconds", "per_kv_token", "drafter", "prefill"})
_OPTIONAL = frozenset({"kv_layout"})


@dataclass(frozen=True)
class ServingCost:
    """Step costs of one modelled serving engine, priced from what each step does (`price`).

    name: file stem of a shipped model; platform: the modelled hardware ("h100-cuda"); sources: where each
    parameter comes from; verify: CostModel T(B, M) of the target's verify step at zero context, width W =
    gamma + 1; plain: BatchCurve over at least B = 1..max_requests (zero context); per_kv_token: seconds per KV
    token held; drafter: DraftCost over depths 1..gamma; prefill: PrefillCost; tiers: graph tiers the modelled
    engine replays (() for eager); parameters: the generator's arguments (JSON values); kv_layout: how the
    modelled attention reads the KV cache (`ragged`: each request's own length; `padded`: every request padded
    to the step's longest).
    """

    name: str
    platform: str
    description: str
    sources: tuple[str, ...]
    verify: CostModel
    plain: BatchCurve
    per_kv_token: float
    drafter: DraftCost
    prefill: PrefillCost
    tiers: tuple[int, ...] = ()
    max_requests: int = 256
    parameters: Mapping[str, Any] = field(default_factory=dict)
    kv_layout: str = "ragged"

    def __post_init__(self) -> None:
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        for name in ("name", "platform"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        check_type("description", self.description, str)
        sources = tuple(check_type("sources", self.sources, (list, tuple)))
        if not sources or not all(isinstance(s, str) and s for s in sources):
            raise ValueError(f"sources must be a non-empty list of non-empty strings, got {self.sources!r}")
        object.__setattr__(self, "sources", sources)
        check_type("verify", self.verify, CostModel)
        if self.verify.width is None:
            raise ValueError("verify must record its width W = gamma + 1, got a cost model with width None")
        check_int("max_requests", self.max_requests, 1)
        check_real("per_kv_token", self.per_kv_token, 0.0, math.inf, high_open=True)
        check_type("drafter", self.drafter, DraftCost)
        check_type("prefill", self.prefill, PrefillCost)
        if self.drafter.max_drafts != self.verify.width - 1:
            raise ValueError(f"the drafter is priced for depths 1..{self.drafter.max_drafts} but verify covers W = "
                             f"{self.verify.width} (gamma = {self.verify.width - 1} drafts): price depths 1..gamma")
        curves = [("plain", self.plain)] + [(f"drafter depth {k}", c)
                                            for k, c in enumerate(self.drafter.seconds_per_depth, 1)]
        for name, curve in curves:
            check_type(name, curve, BatchCurve)
            if curve.batch_sizes[0] != 1 or curve.batch_sizes[-1] < self.max_requests:
                raise ValueError(f"{name} must cover B = 1..max_requests = {self.max_requests}, got batch sizes "
                                 f"{curve.batch_sizes[0]}..{curve.batch_sizes[-1]}")
        tiers = check_type("tiers (() for an eager engine)", self.tiers, (list, tuple))
        object.__setattr__(self, "tiers", check_probes("tiers", tiers, 1) if tiers else ())
        if self.tiers and isinstance(self.verify, TieredCostModel) and tuple(self.verify.tiers) != self.tiers:
            raise ValueError(f"tiers {list(self.tiers)} differ from the tiered verify model's "
                             f"{list(self.verify.tiers)} (() for an eager engine)")
        parameters = dict(check_type("parameters", self.parameters, Mapping))
        gamma = parameters.get("gamma")
        if gamma is not None and gamma != self.verify.width - 1:
            raise ValueError(f"parameters.gamma {gamma!r} differs from the verify model's W - 1 = "
                             f"{self.verify.width - 1}")
        if parameters.get("draft_sha256") is not None:
            check_sha256("parameters.draft_sha256 (or absent)", parameters["draft_sha256"])
        try:
            json.dumps(parameters, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"parameters must hold JSON values (finite numbers, strings, lists), got "
                             f"{parameters!r}: {e}") from None
        object.__setattr__(self, "parameters", parameters)
        _check_coverage(self.verify, self.max_requests)

    @property
    def width(self) -> int:
        """W = gamma + 1 of the verify model."""
        return self.verify.width

    def plain_seconds(self, num_requests: int) -> float:
        """Seconds of a target-only step over B = num_requests requests (in 1..max_requests), zero context."""
        return self.plain(self._batch(num_requests))

    def draft_seconds(self, num_requests: int, drafts: int, catch_up: int = 0) -> float:
        """Seconds of B = num_requests requests (in 1..max_requests) drafting `drafts` tokens each after catching
        up `catch_up` tokens beyond their roots."""
        return self.drafter.seconds(drafts, self._batch(num_requests), catch_up)

    def price(self, work: StepWork) -> float:
        """Seconds of one step that did `work` (the rules in this module's docstring and docs/replay.md)."""
        b = self._batch(check_type("work", work, StepWork).requests)
        target = (float(self.verify.step_seconds(num_requests=b, rows=work.rows)) if work.drafts
                  else self.plain(b))
        kv = self.per_kv_token * kv_priced(work, self.kv_layout)
        return (target + kv + self.drafter.seconds(work.drafts, work.drafting, work.catch_up)
                + self.prefill.seconds(work.prefill_tokens, work.prefill_folded))

    def believed(self, drafts: int, context: float) -> CostModel:
        """T(B, M) of a speculative step drafting `drafts` tokens per request, every request holding `context`
        KV tokens: what a planner profiled at that context believes (a ShiftedCostModel over `verify`)."""
        from dspark.cost.shifted import ShiftedCostModel

        if check_int("drafts", drafts, 1) > self.drafter.max_drafts:
            raise ValueError(f"drafts must be in [1, {self.drafter.max_drafts}] (the depths this drafter is priced "
                             f"for), got {drafts}")
        check_real("context", context, 0.0, math.inf, high_open=True)
        probes = sorted({1, self.max_requests, *self.drafter.seconds_per_depth[drafts - 1].batch_sizes})
        probes = [b for b in probes if b <= self.max_requests]
        shift = [self.per_kv_token * context * b + self.drafter.seconds(drafts, b) for b in probes]
        return ShiftedCostModel(self.verify, probes, shift, width=drafts + 1)

    def believed_plain(self, context: float) -> Callable[[int], float]:
        """B -> seconds of a plain step with every request holding `context` KV tokens."""
        check_real("context", context, 0.0, math.inf, high_open=True)
        return lambda b: self.plain_seconds(b) + self.per_kv_token * context * b

    def _batch(self, num_requests: int) -> int:
        if check_int("num_requests", num_requests, 1) > self.max_requests:
            raise ValueError(f"num_requests must be in [1, max_requests = {self.max_requests}], got {num_requests}")
        return num_requests

    def to_dict(self) -> dict[str, Any]:
        """The JSON object `save` writes (schema, version, every field; the cost model's own `to_dict`)."""
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "name": self.name, "platform": self.platform,
                "description": self.description, "sources": list(self.sources), "max_requests": self.max_requests,
                "tiers": list(self.tiers), "parameters": dict(self.parameters), "verify": self.verify.to_dict(),
                "plain_seconds": self.plain.to_dict(), "per_kv_token": self.per_kv_token,
                "kv_layout": self.kv_layout, "drafter": self.drafter.to_dict(),
                "prefill": {"per_forward": self.prefill.per_forward, "per_token": self.prefill.per_token}}

    @classmethod
    def from_dict(cls, d: object) -> "ServingCost":
        """Validate and rebuild from `to_dict` output."""
        if not isinstance(d, dict):
            raise ValueError(f"a serving cost must be a JSON object, got {type(d).__name__}")
        version = d.get("schema_version")
        if d.get("schema") == SCHEMA and (not isinstance(version, int) or isinstance(version, bool)):
            raise ValueError(f"schema_version must be an int ({SCHEMA_VERSION}), got {version!r}")  # not 2.0, True
        if d.get("schema") == SCHEMA and version == 1:
            raise ValueError("schema version 1 charged every policy for gamma drafts at one fixed context; "
                             "regenerate the file (python -m dspark.lab.cost_models --write NAME) for version "
                             f"{SCHEMA_VERSION}")
        if d.get("schema") != SCHEMA or d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"schema must be {SCHEMA!r} version {SCHEMA_VERSION}, got {d.get('schema')!r} version "
                             f"{d.get('schema_version')!r} (a single cost model loads with dspark.load_cost_model)")
        if "drafter" in d and isinstance(d["drafter"], dict) and "kind" not in d["drafter"]:
            raise ValueError(f"drafter: the serving cost {d.get('name')!r} names no drafter kind; add \"kind\": one "
                             f"of {DRAFTER_KINDS}")
        missing = sorted(_REQUIRED - set(d))
        if missing:
            raise ValueError(f"serving cost is missing {missing}")
        unknown = sorted(set(d) - _REQUIRED - _OPTIONAL)
        if unknown:
            raise ValueError(f"serving cost has unknown fields {unknown} (known: {sorted(_REQUIRED | _OPTIONAL)})")
        parts = {}
        for key, load in (("verify", CostModel.from_dict), ("plain_seconds", BatchCurve.from_dict),
                          ("drafter", DraftCost.from_dict), ("prefill", prefill_from_dict)):
            try:
                parts[key] = load(d[key])
            except (ValueError, TypeError) as e:
                raise ValueError(f"{key}: {e}") from None
        return cls(d["name"], d["platform"], d["description"], d["sources"], parts["verify"], parts["plain_seconds"],
                   d["per_kv_token"], parts["drafter"], parts["prefill"], tiers=d["tiers"],
                   max_requests=d["max_requests"], parameters=d["parameters"], kv_layout=d.get("kv_layout", "ragged"))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the JSON atomically (temp file in the same folder, then rename)."""
        return write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ServingCost":
        """Read and validate a saved serving cost; every error names the file."""
        return load_json_as(path, cls.from_dict)


def _check_coverage(model: CostModel, max_requests: int) -> None:
    """T(B, M) finite and > 0 at every B in 1..max_requests and M in B..B*W; the first bad point is named."""
    w = model.width
    for b in range(1, max_requests + 1):
        seconds = model.seconds_curve(b, b, b * (w - 1) + 1)
        bad = ~(np.isfinite(seconds) & (seconds > 0))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"verify predicts {float(seconds[i])!r} s at B={b}, M={b + i}; a serving cost needs "
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
    if not str(name_or_path).strip():
        raise ValueError(f"name_or_path must name a serving cost or a .json file, got {name_or_path!r}")
    shipped = COST_MODELS_DIR / f"{name_or_path}.json"
    bare = isinstance(name_or_path, str) and path.suffix != ".json" and len(path.parts) == 1
    if bare and shipped.is_file():
        path = shipped
    elif path.is_dir():
        hint = f"; a demo's profile is {path / 'serving_cost.json'}" if (path / "serving_cost.json").is_file() else ""
        raise ValueError(f"serving cost {str(name_or_path)!r} is a folder, not a .json file{hint}")
    elif bare:
        raise ValueError(f"unknown serving cost {name_or_path!r}; shipped: {serving_cost_names()} (or pass the "
                         "path of a .json file)")
    cost = ServingCost.load(path)
    if width is not None:
        try:
            check_cost_model(cost.verify, width=check_int("width", width, 2))
        except ValueError as e:
            name = cost.name if cost.name in serving_cost_names() else "NAME"
            raise ValueError(f"{path}: {e}; or write this model for W={width}: python -m dspark.lab.cost_models "
                             f"--write {name} --gamma {width - 1} --out PATH") from None
    return cost


def perturbed(cost: ServingCost, *, spread: float, seed: int, plain_skew: float = 0.0) -> ServingCost:
    """A seeded copy with every stored seconds value scaled by 1 + eps, eps ~ U(-spread, spread) drawn per value.

    spread: half-width in [0, 1) (0.05 = +-5 %); seed: int >= 0, the same seed gives the same copy; plain_skew:
    plain seconds are further scaled by 1 + plain_skew (> -1), so reality can price plain steps differently
    from speculative ones. Scaled, in this order: the verify model's stored values, the plain curve, per_kv_token,
    each drafter depth's curve, prefill per_forward and per_token, the drafter's per_catch_up_token. When every stored component is >= 0 the copy's
    verify T(B, M) lies in [1 - spread, 1 + spread] x T(B, M), its plain seconds in that band x (1 + plain_skew).
    The copy's drafter keeps its kind only where the draws keep its shape; otherwise it is priced as `ngram`.
    """
    check_type("cost", cost, ServingCost)
    spread = check_real("spread", spread, 0.0, 1.0, high_open=True)
    check_int("seed", seed, 0)
    plain_skew = check_real("plain_skew", plain_skew, -1.0, math.inf, low_open=True, high_open=True)
    spec = cost.verify.to_dict()
    if spec["kind"] not in _PERTURBED_FIELDS:
        raise ValueError(f"perturbed scales cost model kinds {sorted(_PERTURBED_FIELDS)}, got {spec['kind']!r}")
    rng = np.random.default_rng(seed)

    def scaled(values: Any, power: int = 1) -> Any:
        if isinstance(values, list):
            return [scaled(v, power) for v in values]
        return values * (1.0 + rng.uniform(-spread, spread)) ** power

    spec.pop("fit", None)  # the residuals of a fit describe the original, not the copy
    for key, power in _PERTURBED_FIELDS[spec["kind"]]:
        if key in spec:
            spec[key] = scaled(spec[key], power)
    plain = BatchCurve(cost.plain.batch_sizes, [s * (1.0 + plain_skew) for s in scaled(list(cost.plain.seconds))])
    per_kv = scaled(cost.per_kv_token)
    curves = tuple(BatchCurve(c.batch_sizes, scaled(list(c.seconds))) for c in cost.drafter.seconds_per_depth)
    prefill = PrefillCost(scaled(cost.prefill.per_forward), scaled(cost.prefill.per_token))
    catch_up = scaled(cost.drafter.per_catch_up_token)
    try:
        drafter = DraftCost(cost.drafter.kind, curves, catch_up)
    except ValueError:
        drafter = DraftCost("ngram", curves, catch_up)
    how = {"from": cost.name, "spread": spread, "seed": seed, "plain_skew": plain_skew}
    return ServingCost(f"{cost.name}-perturbed", cost.platform,
                       f"{cost.description} Perturbed: every stored seconds value x (1 + U(-{spread:g}, {spread:g})), "
                       f"seed {seed}; plain steps x {1 + plain_skew:g}.",
                       cost.sources + (f"perturbed({how})",), CostModel.from_dict(spec), plain, per_kv, drafter,
                       prefill, tiers=cost.tiers, max_requests=cost.max_requests, kv_layout=cost.kv_layout,
                       parameters={**cost.parameters, "perturbed": how})
