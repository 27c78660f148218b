"""Holding conveyor to a smaller x86 instruction set than the CPU has: ``CONVEYOR_CPU_ISA``.

``CONVEYOR_CPU_ISA=avx2`` makes an AVX-512 machine run the code an AVX2-only machine runs: the
compiled kernels are built for Haswell (AVX2 + FMA, 8-float vectors) instead of ``-march=native``,
and torch's own kernels, oneDNN and MKL are held to AVX2 through their environment variables.
That reproduces, on one host, the code paths (and the reference engine's, see
``benchmarks/reference_engine.py``) of the 2-core AVX2 machines conveyor's CPU figures are asked for,
without one: caches, clock and memory stay this host's, so it answers "which code runs and how
fast is it relative to the other engine", not "what would that machine measure".

The library variables must be in the environment before torch runs its first op, so the
``conveyor`` command applies them first thing (``apply``) and every process it starts inherits
them; the engine also adds them to each worker process's environment, so a program that imports
conveyor gets them where the model runs, except in its own process (an in-process engine), where
it sets them itself (``library_env``). A value set explicitly by the user is never overridden.
"""

from __future__ import annotations

import os
import platform

ENV = "CONVEYOR_CPU_ISA"
X86_MACHINES = ("x86_64", "amd64", "i686", "i386")
CHOICES = ("native", "avx2")
# Haswell is the first x86 with both AVX2 and FMA, the baseline the AVX2 paths are written for.
_MARCH = {"native": "-march=native", "avx2": "-march=haswell"}
_LIBRARY_ENV = {
    "native": {},
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",  # torch's vectorised CPU kernels
        "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN's GEMMs, packed linears and convolutions
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL's GEMMs
    },
}


def requested() -> str:
    """``CONVEYOR_CPU_ISA``'s value (default ``native``); anything else, or an x86 instruction
    set on another CPU, stops with its name."""
    value = os.environ.get(ENV, "").strip().lower() or "native"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not one of {', '.join(CHOICES)}")
    if value != "native" and platform.machine().lower() not in X86_MACHINES:
        raise ValueError(f"{ENV}={value} holds an x86 CPU; this one is {platform.machine()}")
    return value


def march_flag() -> str:
    """The ``-march`` the compiled kernels are built with first."""
    return _MARCH[requested()]


def library_env(isa: str | None = None) -> dict[str, str]:
    """The variables that hold torch, oneDNN and MKL to ``isa`` (default: the requested one)."""
    return dict(_LIBRARY_ENV[isa or requested()])


def apply() -> dict[str, str]:
    """Puts ``library_env()`` into this process's environment where the user has not set a
    variable already; returns what it set. Call before torch runs anything."""
    added = {}
    for name, value in library_env().items():
        if name not in os.environ:
            os.environ[name] = value
            added[name] = value
    return added
