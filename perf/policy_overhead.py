"""A policy's host time per decode step on the CPU, without a model: what the adaptive policy's decisions cost.

The policy lab's replay (recorded drafts and outcomes, simulated target and drafter: no forward runs) drives
each policy as the lab builds it (adaptive: the speculate-or-not gate, the depth choice, the realised-acceptance
feedback), and the wall clock times the policy's own hooks each step: `speculate`, `confidence`, `plan`,
`admit`, `observe`, `observe_seconds`. These are what the engine's `t_plan` holds on top of the verify step.
Per policy and B: the median and p90 microseconds per step over every step of `--repeats` replays of the
lab's queue, the mean, each hook's share of the mean, the ragged layout built inside the hooks (the
planner's; a fixed k's target builds its own in the verify phase) and the share of the planner's host steps that
skipped the budget scan (`full_window_bound`). The replay is identical from run to run, so two
checkouts compare on the same steps. With `--evict-mb M` an untimed read of an M MiB buffer runs before each
step's `speculate`, `plan` and `observe`, where a live step runs a forward (the previous step's verify, the draft,
the verify): the hooks then run with cold caches, as in the live loop:

    PYTHONPATH=. python perf/policy_overhead.py [--cost cpu-measured] [--batch-sizes 1,4,16,64] \
        [--evict-mb 128] [--label after] [--out perf/results/policy_overhead.json]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from labelled import save_labelled  # perf/labelled.py: a script's own folder is first on sys.path

import dspark
from dspark.cost.serving import load_serving_cost
from dspark.lab.replay.lab import Lab, serving_queue
from dspark.lab.replay.trace import load_trace
from dspark.lab.replay.variants import fit_trace_temperatures
from dspark.plan.planner import VerifyPlanner
from dspark.serve.policies import Policy
from dspark.util.options import at_least, int_list, output_path
from dspark.verify.layout import RaggedVerifyLayout

HOOKS = ("speculate", "confidence", "plan", "admit", "observe", "observe_seconds")
EVICT_BEFORE = ("speculate", "plan", "observe")  # hooks a live step reaches after a forward
POLICIES = ("adaptive", "adaptive-est", "fixed-1")


class HookClock:
    """Times a policy object's hooks with `clock` (seconds); a step's record starts at its `speculate`, the first
    hook of every step of a drafting policy (hooks before the first one, the first admission's, are not counted).
    evict: run untimed before each hook of `EVICT_BEFORE` (None: nothing)."""

    def __init__(self, policy: Policy, clock: Callable[[], float] = time.perf_counter,
                 evict: Callable[[], object] | None = None) -> None:
        self.steps: list[float] = []
        self.by_hook = dict.fromkeys(HOOKS, 0.0)  # seconds of each hook over the counted steps
        self.layout = 0.0  # seconds of the ragged layouts built inside the counted hooks (`layout_timer`)
        self.inside = False  # a hook is running
        self.clock, self.evict = clock, evict
        for name in HOOKS:
            setattr(policy, name, self._timed(name, getattr(policy, name)))

    def _timed(self, name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if self.evict is not None and name in EVICT_BEFORE:
                self.evict()
            if name == "speculate":
                self.steps.append(0.0)
            t0, self.inside = self.clock(), bool(self.steps)
            try:
                return hook(*args, **kwargs)
            finally:
                self.inside = False
                if self.steps:
                    seconds = self.clock() - t0
                    self.steps[-1] += seconds
                    self.by_hook[name] += seconds
        return run


@contextlib.contextmanager
def layout_timer(clock: HookClock) -> Iterator[None]:
    """Adds the seconds of every `RaggedVerifyLayout` built inside one of `clock`'s counted hooks to
    `clock.layout` (the planner's layout: a fixed k's is built in the verify phase, outside its hooks)."""
    original = RaggedVerifyLayout.__dict__["_from_lens"]

    def timed(cls: type, *args: Any, **kwargs: Any) -> RaggedVerifyLayout:
        inside, t0 = clock.inside, clock.clock()
        try:
            return original.__func__(cls, *args, **kwargs)
        finally:
            if inside:
                clock.layout += clock.clock() - t0
    RaggedVerifyLayout._from_lens = classmethod(timed)
    try:
        yield
    finally:
        RaggedVerifyLayout._from_lens = original


@contextlib.contextmanager
def shortcut_counter(counts: list[int]) -> Iterator[None]:
    """Counts the planners' host steps in `counts` [taken, asked]: those that verified every candidate without the
    budget scan (`VerifyPlanner._takes_all`, `full_window_bound`) and all of them; none counted by a checkout
    without the shortcut."""
    original = VerifyPlanner.__dict__.get("_takes_all")
    if original is None:
        yield
        return

    def counted(self: VerifyPlanner, *args: Any, **kwargs: Any) -> bool:
        taken = original(self, *args, **kwargs)
        counts[0] += taken
        counts[1] += 1
        return taken
    VerifyPlanner._takes_all = counted
    try:
        yield
    finally:
        VerifyPlanner._takes_all = original


def evictor(mib: int) -> Callable[[], object] | None:
    """A read of a `mib` MiB buffer (None for 0): what a forward does to the caches between a policy's hooks."""
    if mib == 0:
        return None
    buffer = np.ones(mib * 2**20 // 8)
    return buffer.sum


def measure(lab: Lab, name: str, b: int, repeats: int, evict: Callable[[], object] | None = None) -> dict:
    """Microseconds of `name`'s hooks per step at B = b over `repeats` replays of the lab's queue (`evict` before
    the hooks of `EVICT_BEFORE`)."""
    queue = serving_queue(lab.trace, b)
    steps: list[float] = []
    by_hook, layout, shortcut = dict.fromkeys(HOOKS, 0.0), 0.0, [0, 0]
    for _ in range(repeats):
        lab.estimators.clear()  # adaptive-est: a fresh estimator per replay, as the lab runs it
        policy = lab.policy(name, b)
        clock = HookClock(policy, evict=evict)
        with layout_timer(clock), shortcut_counter(shortcut):
            lab.run(policy, b, queue.ids)
        steps += clock.steps
        by_hook = {h: by_hook[h] + clock.by_hook[h] for h in HOOKS}
        layout += clock.layout
    us = np.asarray(steps) * 1e6
    return {"steps": len(steps), "median_us": float(np.median(us)), "p90_us": float(np.percentile(us, 90)),
            "mean_us": float(us.mean()), "mean_us_by_hook": {h: by_hook[h] * 1e6 / len(steps) for h in HOOKS},
            "mean_layout_us": layout * 1e6 / len(steps),
            "shortcut_share": shortcut[0] / shortcut[1] if shortcut[1] else None}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cost", default="cpu-measured", help="the serving cost the lab prices (and the policies believe)")
    ap.add_argument("--batch-sizes", type=int_list(1), default=(1, 4, 16, 64))
    ap.add_argument("--repeats", type=at_least(1), default=3)
    ap.add_argument("--evict-mb", type=at_least(0), default=0,
                    help="MiB read before each step's speculate / plan / observe: cold caches, as live (0: warm)")
    ap.add_argument("--label", default="current")
    ap.add_argument("--out", type=output_path(), default="perf/results/policy_overhead.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    trace = load_trace()
    temps, _ = fit_trace_temperatures(trace, 3)
    lab = Lab(trace, load_serving_cost(args.cost, width=4), 3, temperatures=temps)
    evict = evictor(args.evict_mb)
    rows = {f"{name}@{b}": measure(lab, name, b, args.repeats, evict) for b in args.batch_sizes for name in POLICIES}
    caches = f"caches evicted by {args.evict_mb} MiB reads" if evict else "warm caches"
    print(f"{args.label} (dspark at {Path(dspark.__file__).parent}, {args.cost}, {caches}): policy hooks, us per step")
    print(f"{'policy@B':>16} {'steps':>7} {'median':>8} {'p90':>8} {'mean':>8} {'layout':>7} {'shortcut':>8}   "
          "mean per hook: " + " / ".join(HOOKS))
    for key, r in rows.items():
        hooks = " / ".join(f"{r['mean_us_by_hook'][h]:.1f}" for h in HOOKS)
        share = "-" if r["shortcut_share"] is None else f"{r['shortcut_share']:.2f}"
        print(f"{key:>16} {r['steps']:>7} {r['median_us']:>8.1f} {r['p90_us']:>8.1f} {r['mean_us']:>8.1f} "
              f"{r['mean_layout_us']:>7.1f} {share:>8}   {hooks}")
    return save_labelled(args.out, args.label, {
        "dspark": str(Path(dspark.__file__).parent), "cost": args.cost, "repeats": args.repeats,
        "evict_mb": args.evict_mb, "rows": rows,
        "median_of_medians_us": statistics.median(r["median_us"] for r in rows.values())})


if __name__ == "__main__":
    main()
