"""Argument types for the commands' number flags: NaN and infinity never get past the parser.

Runs wherever a conveyor command parses its flags (the supervisor, the engine core, a frontend,
``conveyor generate``, ``conveyor bench offline``). ``float()`` reads ``nan`` and ``inf``, and
every comparison with NaN is false, so a range check such as ``value <= 0`` lets NaN through to
the first place that needs a number (``--tbt-slo-ms nan`` killed the engine on its first
request). Every float flag takes one of these types instead of ``float``; a test finds every
float flag of every command and gives it ``nan`` and ``inf``. Token counts and sizes also take
vLLM's spelling (``human_readable_int``: ``32k``, ``32K``; ``human_readable_int_or_auto`` adds
``auto`` and ``-1``), so that a vLLM command line means the same here.
"""

from __future__ import annotations

import argparse
import math
import re
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


# vLLM's size suffixes: lower case decimal, upper case binary ("32k" is 32,000, "32K" 32,768).
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")


def human_readable_int(text: str) -> int:
    """An integer as vLLM's flags write it: ``4096``, ``32k`` (32,000), ``25.6k`` (25,600),
    ``32K`` (32,768); a binary suffix takes whole numbers only."""
    text = text.strip()
    match = _SIZE.fullmatch(text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not an integer: {text!r} (a number, or one with a suffix: 32k = 32,000, "
                "32K = 32,768)"
            ) from None
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a binary suffix ({suffix}) takes a whole number; "
            f"{number}{suffix.lower()} is decimal"
        )
    return int(number) * _BINARY_SUFFIXES[suffix]


def positive_human_readable_int(text: str) -> int:
    """``human_readable_int`` that is at least 1."""
    value = human_readable_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def human_readable_int_or_auto(text: str) -> int | None:
    """``human_readable_int``, or ``auto`` / ``-1`` (vLLM's "as much as fits"): None."""
    if text.strip() in ("-1", "auto", "AUTO", "Auto"):
        return None
    return positive_human_readable_int(text)
