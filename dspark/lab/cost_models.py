"""The command that writes the shipped serving cost models (graphs/cost_models/<name>.json):

    python -m dspark.lab.cost_models --write NAME [--gamma G] [--out PATH]

- the analytic ones (`dspark.cost.shipped.ANALYTIC`): pure functions of their arguments, the same file bit for bit;
- `cpu-measured`: this machine, profiled by the demo's own code (`dspark.lab.profile`; needs the models extra).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Callable, Sequence

import torch

from dspark.cost.base import check_probes
from dspark.cost.serving import COST_MODELS_DIR, ServingCost
from dspark.cost.shipped import ANALYTIC, LONG_PROMPT, ServingCostSpec, doublings
from dspark.lab.demo.config import DemoConfig, demo_clock, demo_tiers, length_range
from dspark.lab.demo.models import load_models
from dspark.lab.profile import ProfileRuns
from dspark.lab.serving_profile import profile_serving_cost
from dspark.models.corpus import prompt_windows
from dspark.models.draft import DEFAULT_WEIGHTS, file_sha256
from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.util.validate import check_int


def cpu_measured(*, gamma: int = 3, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), max_requests: int = 256,
                 repeats: int = 2, seed: int = 0) -> ServingCost:
    """Profile this CPU with the demo's own code: SmolLM2 + its shipped draft, the demo's tiers, clock and threads.

    gamma: the deepest draft priced (W = gamma + 1); batch_sizes: the profiled B; max_requests: the largest B
    covered (past the profiled ones, `scale_batches`); repeats: lockstep sweeps per point (the median is kept);
    seed: the held-out prompt draw.
    """
    sizes = check_probes("batch_sizes", sorted(batch_sizes), 1)
    cfg = DemoConfig(batch_sizes=sizes + tuple(doublings(sizes[-1], check_int("max_requests", max_requests, 1))),
                     gamma=check_int("gamma", gamma, 1), profile_repeats=check_int("repeats", repeats, 1),
                     seed=check_int("seed", seed, 0))
    torch.set_num_threads(cfg.threads)
    load = os.getloadavg()[0]
    target, draft, encode = load_models(torch.device("cpu"))
    longest, width, tiers = length_range(cfg.max_new_tokens, cfg.length_spread)[1], gamma + 1, demo_tiers(cfg)
    prompts, long = (prompt_windows("heldout", encode, sizes[-1], n, cfg.seed) for n in (cfg.prompt_len, LONG_PROMPT))

    def decoder(b: int) -> SpecDecoder:  # one decoder per B holding the tiers its steps replay: memory stays bounded
        return SpecDecoder(target, draft, EngineConfig(
            cache_tokens=b * (LONG_PROMPT + longest + width + 16), tiers=[t for t in tiers if b <= t <= b * width],
            clock=demo_clock(cfg), reserve_new_tokens=longest))

    parameters = {"gamma": gamma, "batch_sizes": list(sizes), "repeats": repeats, "seed": seed,
                  "tokens": cfg.max_new_tokens, "prompt_len": cfg.prompt_len, "threads": cfg.threads,
                  "clock": demo_clock(cfg), "tier_ladder": list(tiers), "draft_sha256": file_sha256(DEFAULT_WEIGHTS)}
    spec = ServingCostSpec("cpu-measured", "", gamma=gamma, max_requests=max_requests, tiers=tiers,
                           parameters={**parameters, "long_prompt_len": LONG_PROMPT})
    cost = profile_serving_cost(decoder, prompts, sizes, spec, runs=ProfileRuns(cfg.max_new_tokens, repeats),
                                long_prompts=long)
    loads = [load, os.getloadavg()[0]]
    return dataclasses.replace(
        cost, description="SmolLM2-135M-Instruct + dspark's shipped block draft on this CPU (one thread, the demo's "
        f"tiers and thread clock), profiled by the demo's own code at B <= {sizes[-1]} (1-minute load average at "
        f"start / end: {loads[0]:.2f} / {loads[1]:.2f}); larger B scaled in proportion.",
        parameters={**cost.parameters, "load_average_1min": loads})


GENERATORS: dict[str, Callable[..., ServingCost]] = {**ANALYTIC, "cpu-measured": cpu_measured}


def main(argv: Sequence[str] | None = None) -> Path:
    """`--write NAME [--gamma G] [--out PATH]`: write a shipped serving cost (default graphs/cost_models/NAME.json)."""
    parser = argparse.ArgumentParser(prog="python -m dspark.lab.cost_models", description=main.__doc__)
    parser.add_argument("--write", required=True, choices=sorted(GENERATORS))
    parser.add_argument("--gamma", type=int, default=3, help="drafts per request per step (W = gamma + 1)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        cost = GENERATORS[args.write](gamma=args.gamma)
    except ValueError as e:
        parser.error(str(e))
    path = cost.save(args.out or COST_MODELS_DIR / f"{args.write}.json")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
