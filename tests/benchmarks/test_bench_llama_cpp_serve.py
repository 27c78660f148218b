"""``python -m benchmarks llama-cpp-serve``: without llama-server it says why and does nothing;
the requests it sends both servers are the offline workload's shapes, as token ids."""

from __future__ import annotations

import json

from benchmarks import llama_cpp_serve
from conveyor.bench.offline import WORKLOADS


def test_skips_with_a_reason_without_llama_server(capsys, tmp_path):
    assert llama_cpp_serve.main([]) == 0
    assert "skipped: no llama.cpp given (--llama-cpp-dir)" in capsys.readouterr().out
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    for name in ("llama-batched-bench", "llama-quantize"):
        (bin_dir / name).write_text("")
    assert llama_cpp_serve.main(["--llama-cpp-dir", str(tmp_path)]) == 0
    assert f"skipped: {bin_dir}/llama-server not found (build llama-server)" in (
        capsys.readouterr().out
    )


def test_requests_take_the_workload_shapes_in_turn(tmp_path):
    path = tmp_path / "requests.jsonl"
    longest = llama_cpp_serve.write_requests(path, "mix", 5, vocab_size=1000)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    shapes = WORKLOADS["mix"]
    assert longest == (max(p for p, _ in shapes), max(o for _, o in shapes))
    assert [(len(r["prompt"]), r["max_tokens"]) for r in records] == [
        shapes[i % len(shapes)] for i in range(5)
    ]
    ids = [token for r in records for token in r["prompt"]]
    assert all(isinstance(t, int) and 10 <= t < 1000 for t in ids)
    # The same file every time: both servers, every round, get the same requests.
    again = tmp_path / "again.jsonl"
    llama_cpp_serve.write_requests(again, "mix", 5, vocab_size=1000)
    assert again.read_text() == path.read_text()
