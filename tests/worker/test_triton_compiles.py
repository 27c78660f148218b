"""Every Triton kernel compiles for a Hopper GPU (sm_90) here, without one
(scripts/compile_triton_sm90.py says why and what it builds). In a child process: the suite runs
the kernels in Triton's interpreter, whose kernels cannot be compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.worker.attention.triton_backend import triton_import_error

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(triton_import_error() is not None, reason="needs triton")
def test_every_triton_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not found in a cache
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_triton_sm90.py"), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in results if not r["ok"]]
    assert done.returncode == 0 and not failed, failed or done.stderr[-2000:]
    kernels = {r["kernel"].split(":")[0].split(" (")[0] for r in results}
    assert kernels == {"paged_attention", "reduce_segments", "store_kv"} | {
        "qk_norm_rope",
        "add_rms_norm",
        "silu_and_mul",
        "lora_shrink",
        "lora_expand",
        "quant_gemm",
    }
    assert sum(r["kernel"].startswith("paged_attention") for r in results) == 6
    assert sum(r["kernel"].startswith("quant_gemm") for r in results) == 9


def test_the_compile_check_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_triton_sm90.py")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2 and "unset TRITON_INTERPRET" in done.stderr
