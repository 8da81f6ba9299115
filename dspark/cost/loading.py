"""Where a cost model meets a run: load any registered model from JSON (`load_cost_model`) and check that it
fits the run's verify width and platform (`check_cost_model`)."""
from __future__ import annotations

import os

from dspark.cost.base import CostModel


def load_cost_model(path: str | os.PathLike) -> CostModel:
    """Load any registered cost model from JSON, dispatching on its `kind`."""
    return CostModel.load(path)


def platform_device_type(platform: str) -> str:
    """The device type a platform string names: its last `-`-separated part ("x86_64-cuda" -> "cuda")."""
    return platform.rsplit("-", 1)[-1]


def check_cost_model(model: object, *, width: int | None = None, platform: str | None = None) -> CostModel:
    """The one rule where a cost model meets a run: the model's W must be the run's W = gamma + 1, and the
    device type of its platform (`platform_device_type`) the run's. A model that records no W (None) or
    no platform ("unknown") is accepted for any. ValueError naming both sides and what to re-profile."""
    if not isinstance(model, CostModel):
        raise TypeError(f"cost_model must be a CostModel, got {type(model).__name__}: {model!r}")
    if width is not None and model.width is not None and model.width != width:
        raise ValueError(f"cost model {model.kind!r} was profiled for W={model.width}, this run has W={width} "
                         f"(gamma={width - 1}): re-profile the verify step at gamma={width - 1} "
                         f"(perf/tier_sweep.py) or run with gamma={model.width - 1}")
    if (platform is not None and model.platform != "unknown"
            and platform_device_type(model.platform) != platform_device_type(platform)):
        raise ValueError(f"cost model {model.kind!r} was profiled on platform {model.platform!r}, this run is on "
                         f"{platform!r}: re-profile the verify step on this platform (perf/tier_sweep.py) or "
                         "load the table profiled for it")
    return model
