"""Policies by name: `fixed-<k>`, `adaptive`, `adaptive-est`, `oracle` (`make_policy`)."""
from __future__ import annotations

from typing import Callable

from dspark.calibration.online import OnlineAcceptanceEstimator
from dspark.plan.planner import VerifyPlanner
from dspark.serve.policies.adaptive import Adaptive
from dspark.serve.policies.base import Policy
from dspark.serve.policies.fixed import FixedK
from dspark.serve.policies.gate import GateSettings
from dspark.serve.policies.oracle import Oracle

ADAPTIVE = ("adaptive", "adaptive-est")  # the planner with the head + STS / with the online estimator


def make_policy(name: str, gamma: int, planner_factory: Callable[[bool, int], VerifyPlanner],
                plain_seconds: Callable[[int], float] | None = None, gate: GateSettings = GateSettings(),
                estimator: OnlineAcceptanceEstimator | None = None, choose_depth: bool = False) -> Policy:
    """The policy named `name` (`fixed-<k>`, `adaptive`, `adaptive-est`, `oracle`).

    planner_factory(sts, depth): the VerifyPlanner of the batch drafting `depth` tokens, with STS temperatures when
    sts; plain_seconds: the profiled plain step (B -> seconds); gate: the adaptive policies' speculate-or-not
    settings; estimator: the online estimator `adaptive-est` reads (one instance may serve many runs);
    choose_depth: the adaptive policies also choose the draft depth 1..gamma per step."""
    if name in ADAPTIVE:
        est = estimator if name == "adaptive-est" else None
        depths = {k: planner_factory(est is None, k) for k in range(1, gamma)} if choose_depth else None
        return Adaptive(planner_factory(est is None, gamma), plain_seconds, gate, estimator=est, depths=depths)
    if name == "oracle":
        return Oracle(gamma)
    if not name.startswith("fixed-") or not name[6:].isdigit():
        raise ValueError(f"unknown policy {name!r}: choose fixed-<k>, adaptive, adaptive-est or oracle")
    return FixedK(int(name[6:]))
