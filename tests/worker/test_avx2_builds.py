"""CONVEYOR_CPU_ISA=avx2: every compiled kernel built as on an AVX2-only CPU, and still right.

The kernels' AVX-512 code runs on this machine by default; the AVX2 code (8-float vectors, 16
registers, the int8 kernel's 16-column panels) is what the 2-core AVX2 machines run. This runs
the kernels' own tests against the torch path with that build, in a child whose environment
holds everything to AVX2, and checks that what it built touches no AVX-512 register.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.worker.native import find_compiler
from tests.devices import x86_only

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = [
    "tests/worker/test_cpu_kernel.py",
    "tests/worker/test_prefill_kernel.py",
    "tests/worker/test_cpu_ops.py",
    "tests/worker/test_int8_linear.py",
    "tests/worker/test_int4_kernel.py",
    "tests/worker/test_lora_kernel.py",
]


@pytest.mark.slow
@x86_only
@pytest.mark.skipif(find_compiler() is None, reason="no C compiler on this machine")
def test_the_avx2_builds_pass_the_kernel_tests(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY",)}
    env.update(CONVEYOR_CPU_ISA="avx2", CONVEYOR_CACHE=str(tmp_path))
    # runtime.cpu_isa.apply() is what the `conveyor` command does first; pytest is not that
    # command, so the child applies it before torch loads.
    code = (
        "import sys; from conveyor.runtime import cpu_isa; cpu_isa.apply(); import pytest; "
        "sys.exit(pytest.main(sys.argv[1:]))"
    )
    # Those two choose their own flags; an AVX2 build has no AMX path and no VNNI (W8A8) path
    # to test.
    deselect = "not concurrent_builds and not fallback_builds and not amx and not w8a8"
    result = subprocess.run(
        [sys.executable, "-c", code, "-q", "-p", "no:cacheprovider", "-k", deselect, *KERNEL_TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1]
    libraries = sorted((tmp_path / "kernels").glob("*.so"))
    names = {path.name.rsplit("-", 1)[0] for path in libraries}
    assert {"paged_attention", "token_ops", "int8_gemm", "lora_sgmv"} <= names, names
    objdump = shutil.which("objdump")
    if objdump is None:
        return
    for path in libraries:
        listing = subprocess.run(
            [objdump, "-d", str(path)], capture_output=True, text=True, check=True
        ).stdout
        assert "%zmm" not in listing and "%k1" not in listing, f"{path.name} has AVX-512 code"
        assert "%ymm" in listing, f"{path.name} has no AVX2 code"
