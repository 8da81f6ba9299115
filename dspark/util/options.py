"""argparse option types that check a value while the command line is parsed, so a bad value fails before
any work (a model load, a sweep) and argparse's message names the option: `argument --repeats: value must be
an int >= 1, got 0`. Used by the `dspark` subcommands and the `perf/` scripts."""
from __future__ import annotations

import argparse
import math
from typing import Callable

import torch

from dspark.util.validate import check_int, check_output_path, check_real


def _parsed(convert: Callable[[str], object], text: str, what: str) -> object:
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def at_least(minimum: int) -> Callable[[str], int]:
    """An int option >= minimum."""
    def parse(text: str) -> int:
        try:
            return check_int("value", _parsed(int, text, "an int"), minimum)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = f"int >= {minimum}"
    return parse


def real(low: float = -math.inf, high: float = math.inf, *, low_open: bool = False,
         high_open: bool = False) -> Callable[[str], float]:
    """A real option in the interval (NaN never; infinities only when an end is an open infinity)."""
    def parse(text: str) -> float:
        try:
            return check_real("value", _parsed(float, text, "a number"), low, high, low_open=low_open,
                              high_open=high_open)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = "number"
    return parse


def int_list(minimum: int = 1) -> Callable[[str], tuple[int, ...]]:
    """A comma list of ints (`1,4,16`), each >= minimum."""
    def parse(text: str) -> tuple[int, ...]:
        values = tuple(_parsed(int, v, "a comma list of ints such as 1,4,16") for v in text.split(","))
        bad = [v for v in values if v < minimum]
        if bad:
            raise argparse.ArgumentTypeError(f"every value must be an int >= {minimum}, got {bad[0]} in {text!r}")
        return values  # type: ignore[return-value]
    parse.__name__ = "int list"
    return parse


POSITIVE_REAL = real(0.0, math.inf, low_open=True, high_open=True)
NONNEGATIVE_REAL = real(0.0, math.inf, high_open=True)


def output_path(folder: bool = False) -> Callable[[str], str]:
    """An output file (or folder) that can be written (`check_output_path`); the text is returned as given."""
    def parse(text: str) -> str:
        try:
            check_output_path("path", text, folder=folder)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    parse.__name__ = "output folder" if folder else "output file"
    return parse


def usable_device(device: str) -> torch.device:
    """The torch device `device` names, after allocating on it once (an `npu` needs torch_npu imported first);
    ValueError naming it and the reason when this machine cannot use it."""
    if str(device).startswith("npu"):
        try:
            import torch_npu  # noqa: F401  (registers the npu device)
        except ImportError:
            raise ValueError("device 'npu' needs torch_npu: pip install 'dspark[npu]'") from None
    try:
        return torch.empty(0, device=device).device
    except (RuntimeError, AssertionError) as e:  # torch's errors for an unknown or unusable device
        raise ValueError(f"device {device!r} is not usable on this machine: {str(e).splitlines()[0][:160]}") from None
