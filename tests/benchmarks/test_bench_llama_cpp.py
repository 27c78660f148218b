"""``python -m benchmarks llama-cpp``: without a llama.cpp build it says why and does nothing;
llama-batched-bench's output is read as it prints it (a fake binary stands in)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from benchmarks import llama_cpp


def test_skips_with_a_reason_when_no_llama_cpp_is_given(capsys, tmp_path):
    assert llama_cpp.main([]) == 0
    assert "skipped: no llama.cpp given (--llama-cpp-dir)" in capsys.readouterr().out
    assert llama_cpp.main(["--llama-cpp-dir", str(tmp_path)]) == 0
    assert f"skipped: {tmp_path}/convert_hf_to_gguf.py not found" in capsys.readouterr().out


def _fake_tree(tmp_path: Path) -> llama_cpp.LlamaCpp:
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    row = {"pl": 8, "tg": 4, "speed_tg": 123.5}
    for name in ("llama-batched-bench", "llama-quantize"):
        script = bin_dir / name
        # Keeps its arguments, and prints a log line and one jsonl row, as the real one does.
        script.write_text(
            f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\necho 'main: n_kv_max'\necho '{json.dumps(row)}'\n"
        )
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    found, why_not = llama_cpp.find_llama_cpp(str(tmp_path), None)
    assert found is not None, why_not
    return found


def test_reads_the_decode_rate_from_batched_bench_jsonl(tmp_path):
    llama = _fake_tree(tmp_path)
    rate = llama_cpp.llama_decode_rate(llama, tmp_path / "m.gguf", 8, 16, 4, 2, repack=False)
    assert rate == 123.5
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-npl") + 1] == "8" and args[args.index("-t") + 1] == "2"
    assert "-nr" in args and args[args.index("-c") + 1] == str(8 * (16 + 4) + 256)
