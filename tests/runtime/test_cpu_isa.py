"""CONVEYOR_CPU_ISA: holding the kernels, torch, oneDNN and MKL to AVX2 on a bigger CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conveyor.runtime import cpu_isa
from tests.devices import x86_only


def test_native_by_default_sets_nothing(monkeypatch):
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    assert cpu_isa.requested() == "native"
    assert cpu_isa.march_flag() == "-march=native"
    assert cpu_isa.library_env() == {}
    monkeypatch.setenv(cpu_isa.ENV, " ")
    assert cpu_isa.requested() == "native"


@x86_only
def test_avx2_names_haswell_and_the_libraries_limits(monkeypatch):
    monkeypatch.setenv(cpu_isa.ENV, "AVX2")
    assert cpu_isa.requested() == "avx2"
    assert cpu_isa.march_flag() == "-march=haswell"
    assert cpu_isa.library_env() == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }


def test_an_unknown_value_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(cpu_isa.ENV, "avx10")
    with pytest.raises(ValueError, match=r"CONVEYOR_CPU_ISA='avx10' is not one of native, avx2"):
        cpu_isa.requested()


def test_avx2_is_refused_on_a_cpu_that_is_not_x86(monkeypatch):
    monkeypatch.setenv(cpu_isa.ENV, "avx2")
    monkeypatch.setattr(cpu_isa.platform, "machine", lambda: "aarch64")
    with pytest.raises(
        ValueError, match="CONVEYOR_CPU_ISA=avx2 holds an x86 CPU; this one is aarch64"
    ):
        cpu_isa.requested()
    monkeypatch.setenv(cpu_isa.ENV, "native")
    assert cpu_isa.requested() == "native"


@x86_only
def test_apply_sets_what_the_user_left_unset(monkeypatch):
    monkeypatch.setenv(cpu_isa.ENV, "avx2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")  # the user's own limit wins
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert cpu_isa.apply() == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "conveyor.entrypoints.cli", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@x86_only
def test_the_command_applies_it_before_running_the_subcommand(monkeypatch):
    from conveyor.entrypoints import cli

    seen = {}
    monkeypatch.setenv(cpu_isa.ENV, "avx2")
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(name, raising=False)

    class Recorder(cli.Command):
        def run(self, argv: list[str]) -> int:
            seen.update(os.environ)
            return 0

    monkeypatch.setitem(cli.COMMANDS, "generate", Recorder("unused", "recorder"))
    assert cli.main(["generate", "out"]) == 0
    assert seen["ATEN_CPU_CAPABILITY"] == "avx2" and seen["ONEDNN_MAX_CPU_ISA"] == "AVX2"


@x86_only
def test_torch_reads_the_limit_when_it_is_set_before_import():
    # What apply() relies on: torch decides its kernels' width at first use, from the environment.
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env[cpu_isa.ENV] = "avx2"
    code = (
        "from conveyor.runtime import cpu_isa; cpu_isa.apply(); import torch; "
        "print(torch.backends.cpu.get_cpu_capability())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "AVX2"


def test_the_command_refuses_an_unknown_value_before_starting_anything():
    result = _cli("generate", "hello", env={cpu_isa.ENV: "sse"})
    assert result.returncode == 2
    assert "CONVEYOR_CPU_ISA='sse' is not one of native, avx2" in result.stderr
    assert "Traceback" not in result.stderr
