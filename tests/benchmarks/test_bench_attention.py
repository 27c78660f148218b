"""python -m benchmarks attention: its side-by-side timing of two versions of the compiled kernel,
and of the bfloat16 build's AMX and FMA paths."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from benchmarks import attention as bench
from conveyor.worker.attention import cpu_kernel
from conveyor.worker.native import find_compiler

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C compiler on this machine")


def test_compare_kernel_times_another_copy_of_the_sources_beside_this_one(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "cache"))
    other = tmp_path / "other"
    shutil.copytree(Path(cpu_kernel.SOURCE_PATH).parent, other)
    argv = ["--compare-kernel", str(other), "--chunk-lens", "17", "--contexts", "40"]
    assert bench.main([*argv, "--rounds", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "config: other kernel, kernel," in out
    row = next(line for line in out.splitlines() if line.startswith("chunk 17, ctx 40"))
    # tokens, two kernels' us, matmuls us, attn/mm, two kernels' GF/s, speed-up
    assert len(row.split()[4:]) == 8


def test_compare_kernel_refuses_a_folder_without_the_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit, match="did not build"):
        bench.main(["--compare-kernel", str(tmp_path), "--chunk-lens", "17"])


def test_compare_kernel_refuses_a_backend_that_does_not_run_the_cpu_kernel():
    # Only the torch backend on the CPU runs the compiled kernel; elsewhere the flag would time
    # nothing it names.
    with pytest.raises(SystemExit, match="--compare-kernel times the compiled CPU kernel"):
        bench.main(["--compare-kernel", "/nowhere", "--backend", "triton", "--chunk-lens", "17"])


def test_cold_evicts_the_caches_before_every_timed_call(monkeypatch, capsys):
    flushes = []
    real = bench.cache_flusher

    def counting_flusher():
        flush = real()
        return lambda: flushes.append(1) or flush()

    monkeypatch.setattr(bench, "cache_flusher", counting_flusher)
    argv = ["--cold", "--chunk-lens", "17", "--contexts", "40", "--rounds", "2", "--repeats", "3"]
    assert bench.main(argv) == 0
    assert next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("chunk 17")
    )
    # 2 rounds x (two attention paths + the matmuls) x 3 timed calls, never the warm-up calls
    assert len(flushes) == 2 * 3 * 3


def test_the_last_level_cache_is_the_largest_size_linux_lists(tmp_path):
    for index, size in enumerate(["48K", "2048K", "32M", "32768K\n"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size)
    assert bench.last_level_cache_bytes(tmp_path) == 32 << 20
    assert bench.last_level_cache_bytes(tmp_path / "missing") == 0


def test_cold_is_refused_off_the_cpu():
    with pytest.raises(SystemExit, match="--cold evicts the CPU's caches"):
        bench.main(["--cold", "--device", "cuda", "--chunk-lens", "17"])


def test_triton_configs_time_each_tile_shape_beside_the_defaults(capsys):
    # In Triton's interpreter here (tests/devices.py), compiled on a GPU: each config must give
    # the defaults' output before its time is printed.
    argv = ["--backend", "triton", "--triton-configs", "16x32,32x16/w2", "--chunk-lens", "20"]
    argv += ["--contexts", "40", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "32"]
    assert bench.main([*argv, "--rounds", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "config: default, 16x32, 32x16/w2," in out
    row = next(line for line in out.splitlines() if line.startswith("chunk 20, ctx 40"))
    # tokens, three configs' us, matmuls us, attn/mm, three configs' GF/s, speed-up
    assert len(row.split()[4:]) == 10


def test_triton_configs_are_refused_for_another_backend_or_a_bad_shape():
    with pytest.raises(SystemExit, match="--triton-configs times the Triton kernel"):
        bench.main(["--triton-configs", "16x32", "--backend", "torch", "--chunk-lens", "17"])
    with pytest.raises(ValueError, match="expected ROWSxKEYS"):
        bench.main(["--triton-configs", "16by32", "--backend", "triton", "--chunk-lens", "17"])


def test_compare_amx_times_both_paths_of_the_bfloat16_build_or_says_what_it_needs(capsys):
    kernel = cpu_kernel.load_kernel(torch.bfloat16)
    argv = ["--dtype", "bfloat16", "--compare-amx", "--chunk-lens", "40", "--contexts", "40"]
    if kernel is None or not kernel.amx:
        with pytest.raises(SystemExit, match="needs the bfloat16 build on a host with AMX"):
            bench.main(argv)
        return
    assert bench.main([*argv, "--rounds", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "config: fma, amx, bfloat16" in out
    row = next(line for line in out.splitlines() if line.startswith("chunk 40, ctx 40"))
    assert len(row.split()[4:]) == 8
