"""Host planning cost of dspark's adaptive policy per speculative step, inside the reference decode loop.

For each batch size B, the adaptive policy (VerifyPlanner, lag 0, always speculating) and fixed-gamma
serve the same continuous-batching queue in `lockstep` rounds (as in `dspark demo`); printed are the
median phase times of their speculative steps (draft / plan / verify / accept, thread CPU time) and the
plan share of the adaptive step. Then the planner's parts are timed in isolation on the confidence
logits the adaptive run recorded: calibrated survival, greedy budget, allocation, layout, the whole
`VerifyPlanner.plan` (warm caches: the in-loop numbers are higher, the model's forwards evict the
planner's data between steps). Writes perf/results/engine_plan_overhead.json.

    PYTHONPATH=. python perf/engine_plan_overhead.py [--batch-sizes 1,4,16,64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Callable

import torch

from dspark.config import ScheduleConfig
from dspark.cost import AdditiveCostModel, BatchTerm, RowTerm
from dspark.lab.demo.config import request_lengths
from dspark.lab.demo.models import load_models
from dspark.lab.timing import lockstep
from dspark.models.corpus import prompt_windows
from dspark.plan.allocate import allocate_verify_lens
from dspark.plan.budget import HostSurvival, greedy_budget
from dspark.plan.planner import PlannerSettings, VerifyPlanner
from dspark.plan.survival import _survival
from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import Adaptive, FixedK
from dspark.util.fileio import write_json_atomic
from dspark.util.options import at_least, int_list, output_path
from dspark.verify.layout import RaggedVerifyLayout

PHASES = ("draft", "plan", "verify", "accept")


def _cost(gamma: int) -> AdditiveCostModel:
    """A convex-in-rows step cost of this CPU's order (2 ms + B-dependent + 40 us per verify row): the
    budget's size matters here, not the exact seconds."""
    rows = [1, 64, 448]
    return AdditiveCostModel(2e-3, BatchTerm([1, 64], [0.0, 8e-3]), RowTerm(rows, [0.0, 40e-6 * 63, 40e-6 * 447]),
                             width=gamma + 1)


def _median_us(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return 1e6 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", type=int_list(1), default="1,4,16,64")
    ap.add_argument("--rounds", type=at_least(1), default=3)
    ap.add_argument("--gamma", type=at_least(1), default=6)
    ap.add_argument("--out", type=output_path(), default="perf/results/engine_plan_overhead.json")
    args = ap.parse_args()
    batch_sizes = list(args.batch_sizes)
    torch.set_num_threads(1)
    target, draft, encode = load_models(torch.device("cpu"))
    cfg, cost = ScheduleConfig(gamma=args.gamma), _cost(args.gamma)
    base = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=max(batch_sizes) * 256, clock="thread"))
    decoders = {"adaptive": base.fork(), f"fixed-{args.gamma}": base.fork()}
    prompts = prompt_windows("heldout", encode, 3 * max(batch_sizes), 32, 0)
    lengths = request_lengths(prompts.shape[0], 32, 0.5, 0)
    results = []
    print(f"{'B':>4} {'policy':<9} " + " ".join(f"{p + ' ms':>10}" for p in PHASES) + f" {'plan share':>10}")
    for b in batch_sizes:
        queue, counts = prompts[: 3 * b], lengths[: 3 * b]

        def policies() -> dict:
            return {"adaptive": Adaptive(VerifyPlanner(cfg, cost, PlannerSettings(lag=0, num_slots=b))),
                    f"fixed-{args.gamma}": FixedK(args.gamma)}

        for name, policy in policies().items():  # warm-up at this B
            decoders[name].generate(queue[:b], 4, policy, max_batch=b)
        steps: dict[str, list] = {name: [] for name in decoders}
        for _ in range(args.rounds):
            runs = lockstep({n: decoders[n].start(queue, counts, p, max_batch=b) for n, p in policies().items()})
            for name, res in runs.items():
                steps[name] += [s for s in res.steps if s.confidence_logits.shape[1]]
        row = {"batch": b, "in_loop_ms": {}}
        for name, ss in steps.items():
            med = {p: 1e3 * statistics.median(getattr(s.times, p) for s in ss) for p in PHASES}
            share = med["plan"] / sum(med.values())
            row["in_loop_ms"][name] = {**med, "plan_share": share, "steps": len(ss)}
            print(f"{b:>4} {name:<9} " + " ".join(f"{med[p]:>10.3f}" for p in PHASES) + f" {100 * share:>9.1f}%")
        full = [s.confidence_logits for s in steps["adaptive"] if s.confidence_logits.shape[0] == b][:200]
        planner = VerifyPlanner(cfg, cost, PlannerSettings(lag=0, num_slots=b))
        slots, gens = torch.arange(b), torch.zeros(b, dtype=torch.int64)
        z = full[len(full) // 2]
        host = _survival(z, None).numpy()
        budget = greedy_budget(HostSurvival(host), cost, cfg).budget
        lens = allocate_verify_lens(HostSurvival(host), budget, cfg)
        parts = {
            "survival": lambda: _survival(z, None),
            "greedy_budget": lambda: greedy_budget(HostSurvival(host), cost, cfg),
            "allocation": lambda: allocate_verify_lens(HostSurvival(host), budget, cfg),
            "layout": lambda: RaggedVerifyLayout.from_verify_lens(lens, width=cfg.width),
            "VerifyPlanner.plan": lambda: planner.plan(z, slots, gens),
        }
        row["isolated_us"] = {k: _median_us(fn, 2000) for k, fn in parts.items()}
        print("      isolated: " + ", ".join(f"{k} {v:.0f} us" for k, v in row["isolated_us"].items()))
        results.append(row)
    write_json_atomic(args.out, {
        "command": f"PYTHONPATH=. python perf/engine_plan_overhead.py --batch-sizes {args.batch_sizes} "
                   f"--rounds {args.rounds} --gamma {args.gamma}",
        "platform": platform.platform(), "torch": torch.__version__, "threads": 1, "clock": "thread",
        "results": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
