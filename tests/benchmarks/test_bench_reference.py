"""python -m benchmarks reference: roofline FLOPs, ratios and medians, the prompts both engines get, and
the pipe to the reference engine's process (against a stub vllm; the real one only where the
reference venv is installed)."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import venv
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import reference as bench
from benchmarks.reference_client import ReferenceEngine, ReferenceEngineError
from benchmarks.roofline import DenseShapes, batch_flops, roofline_share
from conveyor.bench import offline
from tests.devices import x86_only

SHAPES = DenseShapes(
    hidden_size=4,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
    intermediate_size=8,
    vocab_size=10,
)


def test_batch_flops_counts_linears_causal_attention_and_sampled_rows():
    # Linears per token: qkv 4x(2+2)x2=32, o 4x4=16, mlp 3x4x8=96 -> 2 x 2 layers x 144 = 576.
    assert SHAPES.linear_flops_per_token() == 576
    assert SHAPES.attention_flops_per_pair() == 4 * 2 * 2 * 2
    # 3 prompt tokens + 2 outputs: 4 tokens fed (the last output never is), 1+2+3+4 = 10 pairs,
    # 2 LM-head rows.
    assert batch_flops(SHAPES, [3], [2]) == 4 * 576 + 10 * 32 + 2 * 2 * 4 * 10
    assert batch_flops(SHAPES, [3, 3], [2, 2]) == 2 * batch_flops(SHAPES, [3], [2])
    assert roofline_share(100 * 10**9, 2.0, 100.0) == 0.5


def test_shapes_from_a_model_dir(tmp_path: Path):
    config = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8}
    config |= {"num_key_value_heads": 4, "intermediate_size": 1536, "vocab_size": 8192}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes = DenseShapes.from_model_dir(tmp_path)
    assert shapes.head_dim == 64 and shapes.num_kv_heads == 4
    # The bench model: 50.3 M linear FLOPs per token, 8.4 M per LM-head row.
    assert shapes.linear_flops_per_token() == 50_331_648
    assert shapes.lm_head_flops_per_row() == 8_388_608


def _run(seconds: float, num_output: int = 100, num_prompt: int = 100) -> dict[str, object]:
    run = {"seconds": seconds, "num_output_tokens": num_output, "num_prompt_tokens": num_prompt}
    return run | {"other_load": 0.0, "idle_peer_cpu": 0.0}


def test_ratios_and_medians():
    flops = 10**9
    pairs = [
        bench.pair_result(
            bench.summarize(_run(1.0), flops, 10.0), bench.summarize(_run(2.0), flops, 10.0)
        ),
        bench.pair_result(
            bench.summarize(_run(1.0), flops, 10.0), bench.summarize(_run(1.5), flops, 10.0)
        ),
        bench.pair_result(
            bench.summarize(_run(2.0), flops, 10.0), bench.summarize(_run(1.0), flops, 10.0)
        ),
    ]
    first = pairs[0]["conveyor"]
    assert first["output_tok_s"] == 100.0 and first["total_tok_s"] == 200.0
    assert first["roofline"] == 0.1
    assert [p["ratio"] for p in pairs] == [2.0, 1.5, 0.5]
    summary = bench.workload_summary(pairs)
    assert summary["median_ratio"] == 1.5
    assert summary["median_conveyor_roofline"] == 0.1
    assert summary["median_reference_roofline"] == pytest.approx(1 / 15, abs=1e-3)
    # The reference ran at 1/20, 1/15 and 1/10 of the roofline (0.05, 0.067, 0.1 as reported):
    # at 100 % an engine is ~15x it.
    assert summary["ratio_at_roofline"] == pytest.approx(1 / 0.067, abs=1e-3)


def test_reference_flags_follow_conveyors_settings():
    argv = ["--model", "m", "--no-enable-prefix-caching", "--kv-cache-dtype", "bfloat16"]
    args = bench.parse_args(argv)
    engine_args = bench.EngineArgs.from_cli(args)
    flags = bench.reference_flags(engine_args, "/models/m")
    assert flags == [
        "--model=/models/m",
        "--max-num-seqs=64",
        "--max-num-batched-tokens=2048",
        "--dtype=float32",
        "--kv-cache-dtype=bfloat16",
        "--prefix-caching=off",
        "--seed=0",
    ]
    assert bench.workload_sizes(args, "long") == (16, 2)
    assert bench.workload_sizes(bench.parse_args(["--num-requests", "4"]), "mix") == (4, 8)
    with pytest.raises(SystemExit):
        bench.parse_args(["--workloads", "equal,nope"])


def test_int8_is_refused_since_the_reference_would_run_float_weights(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "m", "--quantization", "int8"])
    assert "reference engine runs the same weights unquantized" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--data-parallel-size", "--nnodes"])
def test_more_than_one_worker_is_refused_since_the_reference_runs_one(flag, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "m", flag, "2"])
    assert f"{flag}: the reference engine runs one worker here" in capsys.readouterr().err


class FakeReference:
    pid = 0
    version = "stub"

    def __init__(self) -> None:
        self.batches: list[tuple[list[list[int]], list[int]]] = []

    def generate(self, prompts, max_tokens):
        self.batches.append((prompts, max_tokens))
        return _run(2.0, sum(max_tokens), sum(len(p) for p in prompts))

    def close(self) -> None:
        pass


def test_both_engines_get_the_same_warmup_and_timed_prompts(monkeypatch, tmp_path: Path):
    """The reference gets bench offline's warm-up and timed prompts for each repeat, in order."""
    test_shapes_from_a_model_dir(tmp_path)
    llm = SimpleNamespace(
        config=SimpleNamespace(model=SimpleNamespace(model=str(tmp_path), vocab_size=50)),
        get_tokenizer=lambda: range(1000),
        shutdown=lambda: None,
    )
    conveyor_prompts = []

    def fake_timed_run(llm, args, progress, repeat):
        prompts, params = offline.timed_requests(llm, args.workload, args.num_requests, repeat)
        conveyor_prompts.append(prompts)
        return _run(1.0, sum(p.max_tokens for p in params), sum(len(p) for p in prompts))

    fake = FakeReference()
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)
    monkeypatch.setattr(bench, "start_llm", lambda *a, **k: llm)
    monkeypatch.setattr(bench, "timed_run", fake_timed_run)
    monkeypatch.setattr(bench, "measure_matmul_gflops", lambda: 100.0)
    monkeypatch.setattr(bench.ReferenceEngine, "start", lambda *a: fake)
    args = bench.parse_args(["--model", "m", "--pairs", "2", "--num-requests", "4"])
    result = bench.bench_workload(args, bench.EngineArgs.from_cli(args), "mix")
    warmup, _ = offline.make_requests("mix", 8, 50, seed=1)
    assert fake.batches[0] == (warmup, [32, 128] * 4)
    assert [b[0] for b in fake.batches[1:]] == conveyor_prompts
    assert conveyor_prompts[0] != conveyor_prompts[1]
    assert [p["ratio"] for p in result["pairs"]] == [2.0, 2.0]
    assert result["median_ratio"] == 2.0 and result["calibration_gflops"] == 100.0


STUB_VLLM = '''
    """A stand-in for vllm: LLM.generate returns max_tokens zeros per prompt."""
    from types import SimpleNamespace
    __version__ = "0.0-stub"
    print("stub vllm logs to stdout")

    class SamplingParams:
        def __init__(self, temperature, max_tokens, ignore_eos):
            self.max_tokens = max_tokens

    class LLM:
        def __init__(self, **kwargs):
            assert kwargs["dtype"] == "float32" and kwargs["max_num_seqs"] == 64, kwargs
            assert kwargs["kv_cache_dtype"] == "auto", kwargs

        def generate(self, prompts, params, use_tqdm):
            assert all("prompt_token_ids" in p for p in prompts)
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * p.max_tokens)])
                    for p in params]
'''


def _venv_with_vllm(root: Path, vllm_source: str, torch_cpu_source: str | None = None) -> str:
    """A venv of its own (as the reference engine has) whose `vllm` is the given source, and
    with ``torch_cpu_source``, a `torch` package of just `torch.cpu`."""
    venv.create(root, with_pip=False)
    python = root / "bin" / "python"
    purelib = subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    (Path(purelib) / "vllm").mkdir()
    (Path(purelib) / "vllm" / "__init__.py").write_text(vllm_source)
    if torch_cpu_source is not None:
        (Path(purelib) / "torch").mkdir()
        (Path(purelib) / "torch" / "__init__.py").write_text("")
        (Path(purelib) / "torch" / "cpu.py").write_text(torch_cpu_source)
    return str(python)


def test_reference_engine_pipe_against_a_stub_vllm(tmp_path: Path):
    python = _venv_with_vllm(tmp_path / "venv", textwrap.dedent(STUB_VLLM))
    args = bench.parse_args(["--model", "m"])
    engine = ReferenceEngine.start(
        python, bench.reference_flags(bench.EngineArgs.from_cli(args), "m")
    )
    try:
        assert engine.version == "0.0-stub"
        run = engine.generate([[1, 2, 3], [4]], [5, 7])
        assert run["num_output_tokens"] == 12 and run["num_prompt_tokens"] == 4
        assert run["seconds"] >= 0.0
        assert "stub vllm logs to stdout" in engine.log_tail()
    finally:
        engine.close()


FAKE_TORCH_CPU = """
def _is_avx512_supported():
    return True

def _is_amx_tile_supported():
    return True
"""


@x86_only
def test_avx2_holds_the_reference_engine_to_what_an_avx2_cpu_runs(tmp_path: Path, monkeypatch):
    # vLLM picks its kernel library from torch.cpu's feature queries: they must answer "no
    # AVX-512" in the engine's process, and oneDNN/MKL get conveyor's own limits.
    report = 'import os, torch.cpu\nprint("isa", torch.cpu._is_avx512_supported(), '
    report += 'torch.cpu._is_amx_tile_supported(), os.environ["ONEDNN_MAX_CPU_ISA"])\n'
    stub = report + textwrap.dedent(STUB_VLLM)
    python = _venv_with_vllm(tmp_path / "venv", stub, FAKE_TORCH_CPU)
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "avx2")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    engine = ReferenceEngine.start(python, ["--model=m"])
    try:
        assert "isa False False AVX2" in engine.log_tail()
    finally:
        engine.close()
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "native")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    engine = ReferenceEngine.start(python, ["--model=m"])
    try:
        assert "isa True True ALL" in engine.log_tail()
    finally:
        engine.close()


def test_a_reference_engine_that_dies_is_an_error_with_its_log(tmp_path: Path):
    python = _venv_with_vllm(tmp_path / "venv", "raise ImportError('no AVX-512 here')\n")
    with pytest.raises(ReferenceEngineError, match="no AVX-512 here"):
        ReferenceEngine.start(python, ["--model", "m"])
    with pytest.raises(ReferenceEngineError, match="install_reference_engine.sh"):
        ReferenceEngine.start(str(tmp_path / "missing" / "python"), [])


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("CONVEYOR_TEST_REFERENCE") != "1" or not bench.DEFAULT_REFERENCE_PYTHON.exists(),
    reason="runs vLLM's CPU build for over a minute: set CONVEYOR_TEST_REFERENCE=1 where it is "
    "installed (scripts/install_reference_engine.sh)",
)
def test_side_by_side_with_the_real_reference_engine(capsys):
    from benchmarks.fixtures.model_maker import ensure_model

    # The bench model: vLLM's CPU attention has no kernel for the tiny model's head_dim of 16.
    model_dir = ensure_model("bench", "qwen3")
    argv = ["--model", str(model_dir), "--workloads", "equal", "--pairs", "1", "--json"]
    argv += ["--num-requests", "2", "--num-warmup-requests", "1", "--kv-cache-memory", "32M"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    (result,) = report["workloads"]
    (pair,) = result["pairs"]
    assert pair["conveyor"]["num_output_tokens"] == pair["reference"]["num_output_tokens"] == 256
    assert pair["ratio"] > 0 and result["reference_version"] != "?"
