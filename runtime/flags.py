"""Argument types for the commands' number flags: NaN and infinity never get past the parser.

Runs wherever a conveyor command parses its flags (the supervisor, the engine core, a frontend,
``conveyor generate``, ``conveyor bench offline``). ``float()`` reads ``nan`` and ``inf``, and
every comparison with NaN is false, so a range check such as ``value <= 0`` lets NaN through to
the first place that needs a number (``--tbt-slo-ms nan`` killed the engine on its first
request). Every float flag takes one of these types instead of ``float``; a test finds every
float flag of every command and gives it ``nan`` and ``inf``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def finite_float(text: str) -> float:
    """A flag's float: any finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite float >= 0 (a duration where 0 means "none" or "at once")."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value:g}")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0 (a timeout, a window)."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value:g}")
    return value


def float_at_least(minimum: float) -> Callable[[str], float]:
    """The type of a finite float >= ``minimum`` (a timeout with a floor)."""

    def at_least(text: str) -> float:
        value = finite_float(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum:g}, got {value:g}")
        return value

    return at_least
