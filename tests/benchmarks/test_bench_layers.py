"""``python -m benchmarks layers --section int8`` (float32 and int8 timed on every decoder linear) and
``--section small`` (oneDNN and the kernel for one to eight rows)."""

from __future__ import annotations

import pytest

from benchmarks import attention, layers
from conveyor.worker.layers.cpu_ops import load_token_ops
from conveyor.worker.layers.int8_linear import load_int8_gemm


@pytest.mark.skipif(load_int8_gemm() is None, reason="no C compiler for the int8 kernel")
def test_int8_section_times_both_on_every_decoder_linear(tiny_model_dirs, monkeypatch, capsys):
    # A 1 MiB "cache": a few copies of each tiny weight, not 128 MiB of them.
    monkeypatch.setattr(attention, "last_level_cache_bytes", lambda: 1 << 20)
    argv = ["--model", str(tiny_model_dirs["qwen3"]), "--section", "int8", "--rows", "1,7"]
    assert layers.main([*argv, "--budget", "0.01"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("M=")]
    names = [line.split()[1] for line in lines]
    assert names == ["qkv", "qkv", "o", "o", "gate_up", "gate_up", "down", "down"]
    assert all("float32" in line and "int8" in line and "GF" in line for line in lines)


@pytest.mark.skipif(load_token_ops() is None, reason="no C compiler for the token ops")
def test_small_section_times_onednn_and_small_linear_at_one_to_eight_rows(
    tiny_model_dirs, monkeypatch, capsys
):
    monkeypatch.setattr(attention, "last_level_cache_bytes", lambda: 1 << 20)
    # One to eight rows; rows small_linear does not take are refused, not skipped.
    argv = ["--model", str(tiny_model_dirs["qwen3"]), "--section", "small"]
    with pytest.raises(SystemExit):
        layers.main([*argv, "--rows", "1,9"])
    assert "not --rows 1,9" in capsys.readouterr().err
    assert layers.main([*argv, "--rows", "1,5", "--budget", "0.01"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("M=")]
    assert [(line.split()[0], line.split()[1]) for line in lines] == [
        (f"M={rows}", name)
        for name in ("qkv", "o", "gate_up", "down", "lm_head")
        for rows in (1, 5)
    ]
    assert all("onednn" in line and "small_linear" in line for line in lines)


@pytest.mark.skipif(load_token_ops() is None, reason="no C compiler for the token ops")
def test_model_section_times_one_decode_row_with_and_without_small_linear(tiny_model_dirs, capsys):
    argv = ["--model", str(tiny_model_dirs["qwen3"]), "--section", "model", "--budget", "0.01"]
    assert layers.main(argv) == 0
    lines = {line.split("  ")[0].strip(): line for line in capsys.readouterr().out.splitlines()}
    assert "small_linear off" in lines["decode 1x1"] and "packed on" in lines["decode 1x1"]
    assert "small_linear off" not in lines["decode 64x1"]
