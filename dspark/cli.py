"""Command line: `python -m dspark.cli <subcommand>` (installed as `dspark`).

Each subcommand is one `Subcommand(name, help, add_arguments, run)` entry in `SUBCOMMANDS`; heavy
imports happen inside `run`, so `--help` stays fast and one broken subcommand cannot break the others.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _device_and_out(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, npu (default: cpu)")
    p.add_argument("--out", default="demo_out", help="output folder (default: demo_out/)")


def _run_plan_demo(args: argparse.Namespace) -> int:
    from dspark.planner_demo import run

    return run(device=args.device, out=args.out)


SUBCOMMANDS: list[Subcommand] = [
    Subcommand("demo", "the main demonstration (for now: the planner demonstration)", _device_and_out,
               _run_plan_demo),
    Subcommand("plan-demo", "planner demonstration: budget decision table, tau/T/theta plot, JSON",
               _device_and_out, _run_plan_demo),
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
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
