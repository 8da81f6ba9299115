"""Command line: `python -m dspark.cli <subcommand>` (installed as `dspark`).

Each subcommand is one `Subcommand(name, help, add_arguments, run)` entry in `SUBCOMMANDS`; heavy
imports happen inside `run`, so `--help` stays fast and one broken subcommand cannot break the others.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from dspark.cli import calibrate as calibrate_cli
from dspark.util.options import int_list


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _device_and_out(p: argparse.ArgumentParser, devices: str = "cpu, cuda or npu", out: str = "plan_demo_out"
                    ) -> None:
    p.add_argument("--device", default="cpu", help=f"torch device: {devices} (default: cpu)")
    p.add_argument("--out", default=out, help=f"output folder (default: {out}/)")


def _tiers(text: str) -> tuple[int, ...]:
    """`--tiers`: a comma list of ints, or `eager` (no tiers)."""
    return () if text == "eager" else int_list(1)(text)


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    _device_and_out(p, "cpu or cuda (the Ascend port runs through dspark.ascend, not this loop)", "demo_out")
    p.add_argument("--batch-sizes", type=int_list(1), default=(1, 4, 16), help="comma list (default 1,4,16)")
    p.add_argument("--mode", default="compact", help="verify mode: static, cap-accept or compact (default)")
    p.add_argument("--policies", default="adaptive,adaptive-est,fixed,oracle",
                   help="comma list of adaptive (the draft's confidence head + STS), adaptive-est (the head off, "
                        "an online acceptance estimator in its place), oracle, fixed (= fixed-0..fixed-gamma), "
                        "fixed-K; the n-gram drafter (prompt lookup, no model) beside the block draft: ngram-fixed "
                        "(= ngram-fixed-1..ngram-fixed-gamma), ngram-fixed-K, ngram-adaptive-est")
    p.add_argument("--gamma", type=int, default=3, help="drafts per step, at most the draft's block of 6 (default 3)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=12, help="mean new tokens per request (default 12)")
    p.add_argument("--length-spread", type=float, default=0.5,
                   help="each request's new tokens are uniform in mean x [1 - spread, 1 + spread] (default 0.5; "
                        "0: every request the same length)")
    p.add_argument("--requests-per-slot", type=int, default=4,
                   help="continuous batching: a queue of N = this x B requests is served on B slots (default 4)")
    p.add_argument("--max-requests", type=int, default=32,
                   help="... at most this many requests per queue (default 32: B = 16 gets 2 per slot) ...")
    p.add_argument("--min-requests", type=int, default=4,
                   help="... and at least this many and B (default 4)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed rounds per batch size, every policy once per round, interleaved step by step "
                        "(lockstep); speed-ups are medians of the per-round ratios (default 3)")
    p.add_argument("--profile-repeats", type=int, default=2,
                   help="lockstep sweeps of the step-cost profile, each point the median over them (default 2: "
                        "one sweep's noise was as large as speculation's margin; each sweep costs about a minute)")
    p.add_argument("--sampling", action="store_true", help="rejection sampling instead of greedy")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lag", type=int, default=0,
                   help="planner survival lag (default 0: the budget from live survival, this decode loop does not "
                        "overlap drafting and verification: its argmax when greedy, the early-stop scan with "
                        "--sampling; 1: the overlap scheduler's)")
    p.add_argument("--probe-every", type=int, default=8,
                   help="adaptive: after this many plain steps in a row, speculate once (default 8)")
    p.add_argument("--max-probe-every", type=int, default=64,
                   help="adaptive: the probe interval doubles while plain keeps winning, up to this (default 64)")
    p.add_argument("--cost-feedback", action="store_true",
                   help="adaptive: rescale the profiled step costs online by measured / predicted step times "
                        "(median of the last 9 per step kind). Off by default: the profile is taken in the same "
                        "lockstep conditions as the timed runs, and on a shared CPU a slow spell during a few "
                        "speculative steps would flip the speculate-or-not decision")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: tiny ops)")
    p.add_argument("--tiers", type=_tiers, default=None,
                   help="comma list of token tiers: compact steps pad to the smallest tier >= rows and the "
                        "planner uses a TieredCostModel of the measured tiers (default: 1..6, 8, then x1.5 / "
                        "x4/3 steps, plus every B and B*W); 'eager': no tiers, an additive cost model")
    p.add_argument("--clock", default="auto", choices=("auto", "wall", "thread"),
                   help="step timing: wall, or thread (the decoding thread's CPU time; CPU with --threads 1: "
                        "not charged while other processes hold the core, though still slowed by neighbours "
                        "sharing caches). auto (default): thread on the CPU with 1 thread, else wall")
    p.add_argument("--seed", type=int, default=0)


def _run_demo(args: argparse.Namespace) -> int:
    from dspark.lab.demo.run import DemoConfig, run_demo

    cfg = DemoConfig(
        device=args.device, out=args.out, batch_sizes=args.batch_sizes, mode=args.mode,
        policies=tuple(x for x in args.policies.split(",") if x), gamma=args.gamma, prompt_len=args.prompt_len,
        max_new_tokens=args.max_new_tokens, length_spread=args.length_spread, requests_per_slot=args.requests_per_slot,
        max_requests=args.max_requests, min_requests=args.min_requests, repeats=args.repeats,
        profile_repeats=args.profile_repeats, sampling=args.sampling,
        temperature=args.temperature, lag=args.lag, probe_every=args.probe_every, max_probe_every=args.max_probe_every,
        threads=args.threads, seed=args.seed, tiers=args.tiers, clock=args.clock, cost_feedback=args.cost_feedback,
    )
    try:
        run_demo(cfg)
    except (ValueError, ImportError, FileNotFoundError, MemoryError) as e:
        print(f"dspark demo: error: {e}", file=sys.stderr)
        return 2
    return 0


def _run_plan_demo(args: argparse.Namespace) -> int:
    from dspark.cli.plan_demo import run

    return run(device=args.device, out=args.out)


SUBCOMMANDS: list[Subcommand] = [
    Subcommand("demo", "end-to-end demo: SmolLM2-135M + its draft, every policy side by side, lossless check, "
               "table + JSON + PNGs", _demo_arguments, _run_demo),
    Subcommand("plan-demo", "planner demonstration: budget decision table, tau/T/theta plot, JSON",
               _device_and_out, _run_plan_demo),
    Subcommand("calibrate", calibrate_cli.HELP, calibrate_cli.add_arguments, calibrate_cli.run),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in SUBCOMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; a bad argument value (ValueError) is reported in one line, exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ValueError as e:
        print(f"dspark {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
