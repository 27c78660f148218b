"""``python -m benchmarks gpu-check``: check a GPU machine end to end with one command, and print a table.

    python -m benchmarks gpu-check [--wheels DIR] [--skip-tests] [--compare-backend torch] [--json FILE]
    python -m benchmarks gpu-check --dry-run

1. ``--wheels DIR``: install what this checkout needs and the machine lacks from wheels carried
   there (pip, no index: such a machine may reach no registry;
   docs/performance.md#on-a-gpu-machine says how to download them for its Python);
2. the CUDA tests (``pytest -m "cuda or gpu_kernel"``, with ``CONVEYOR_TEST_DEVICE=cuda``), then
   greedy parity with transformers on CUDA (``tests/frontend/test_parity_hf.py``, float32), each
   bounded in time so that the measurement always runs;
3. a random-weight model with Qwen3-0.6B's shapes in bfloat16, generated once into the model cache;
4. decode step time and output tok/s at batch 1, 16, 64 and 256 with CUDA graphs and eagerly,
   prefill tok/s at 2k, 8k and 32k-token prompts, peak GPU memory, launches per decode step, and
   the decode step against the weight-read limit (benchmarks/gpu_check/measure.py); with
   ``--compare-backend`` the same again with another attention backend, in the same process;
5. ``bench offline`` (``--offline``, default equal and mix, 256 requests) through the
   multi-process engine on the same model;
6. the Triton attention kernel's other tile shapes and launch settings beside its defaults, on
   the model's attention shape, for decode steps and prompt chunks (``bench attention
   --triton-configs``; ``--skip-sweep`` leaves it out).

``--dry-run`` does all of it on the CPU with the tiny test model and small shapes: the CUDA tests
are only collected, and what only CUDA has reads "n/a". The test suite runs it.

Runs in the caller's process, from a checkout: the tests and pyproject.toml are read from the
current directory. Only the standard library is imported before the install step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

CUDA_TEST_FILES = (
    "tests/worker/test_cuda.py",
    "tests/worker/test_attention.py",
    "tests/worker/test_triton_attention.py",
    "tests/worker/test_triton_ops.py",
    "tests/worker/test_cuda_graphs.py",
    "tests/worker/test_lora_triton.py",
    "tests/worker/test_lora_graphs.py",
    "tests/worker/test_triton_quant.py",
)
CUDA_MARKERS = "cuda or gpu_kernel"
# The model tests against transformers, run on the GPU (every engine there on CUDA, in float32):
# scheduling, chunked prompts, prefix hits, preemption and async steps through the CUDA runner.
PARITY_TEST_FILES = ("tests/frontend/test_parity_hf.py",)


# The Triton attention kernel's tile shapes and launch settings timed beside its defaults (bench
# attention --triton-configs, worker/attention/triton_backend.py KernelConfig), per kind of step.
SWEEP_CONFIGS = {
    "decode": "16x32/w2,16x128/w4,16x64/w2/s2,16x128/w8/s3",
    # The default for chunks of 1,024+ tokens is 128x128/w8/s3; 64x64 was it before.
    "prefill": "64x64,128x64/w4/s3,128x128/w8/s2,128x64/w8/s3",
}

# Kept here, not imported from protocol/benchmarks: only the standard library is imported before
# the install step (tests/entrypoints/test_gpu_check.py checks both against their sources).
ATTENTION_BACKENDS = ("auto", "flash-attn", "triton", "torch", "cpu-kernel")
OFFLINE_WORKLOADS = ("equal", "long", "mix", "uneven")


def _workloads(text: str) -> list[str]:
    """``--offline``: comma-separated bench offline workloads, refused if unknown."""
    workloads = [w for w in text.split(",") if w]
    unknown = [w for w in workloads if w not in OFFLINE_WORKLOADS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(OFFLINE_WORKLOADS)}"
        )
    return workloads


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks gpu-check",
        description="Install from carried wheels, run the CUDA tests, measure a Qwen3-0.6B-shaped "
        "model's decode and prefill, print a table.",
    )
    parser.add_argument("--dry-run", action="store_true", help="everything on CPU, tiny shapes")
    parser.add_argument("--wheels", type=Path, help="install missing requirements from here")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the CUDA tests")
    parser.add_argument(
        "--test-timeout", type=float, default=120.0, help="seconds one CUDA test may take"
    )
    parser.add_argument(
        "--tests-timeout", type=float, default=300.0, help="seconds all the CUDA tests may take"
    )
    parser.add_argument(
        "--skip-parity", action="store_true", help="do not run the parity tests on CUDA"
    )
    parser.add_argument(
        "--parity-timeout",
        type=float,
        default=150.0,
        help="seconds the parity tests on CUDA may take (they stop there, the rest is reported)",
    )
    parser.add_argument(
        "--skip-sweep",
        action="store_true",
        help="do not time the Triton attention kernel's other tile shapes",
    )
    parser.add_argument(
        "--sweep-timeout",
        type=float,
        default=90.0,
        help="seconds each tile-shape sweep (decode, prefill) may take",
    )
    parser.add_argument("--model", type=Path, help="measure this model directory instead")
    parser.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="measure with this attention backend",
    )
    parser.add_argument(
        "--compare-backend",
        choices=ATTENTION_BACKENDS,
        default=None,
        help="measure decode and prefill again with this backend, in the same process (on a GPU "
        "machine: torch, against the Triton or flash-attn default)",
    )
    parser.add_argument(
        "--offline",
        type=_workloads,
        default="equal,mix",
        help="bench offline workloads through the multi-process engine ('' for none)",
    )
    parser.add_argument("--offline-requests", type=int, default=None, help="requests per workload")
    parser.add_argument("--batches", default=None, help="decode batch sizes (default 1,16,64,256)")
    parser.add_argument("--prompts", default=None, help="prefill lengths (default 2048,8192,32768)")
    parser.add_argument("--context", type=int, default=None, help="tokens per decode request")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per mode")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=None, help="CUDA (default: 0.9)"
    )
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    return parser.parse_args(argv)


# ------------------------------------------------------------------ 1. carried wheels


def _requirements(pyproject: Path) -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: no TOML reader in the standard library
        return []
    return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])


def _installed(requirement: str) -> bool:
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def install_from_wheels(wheels: Path) -> None:
    """pip-install, from ``wheels`` only, the requirements this environment lacks (and
    flash-attn, when a wheel of it was carried)."""
    missing = [r for r in _requirements(Path("pyproject.toml")) if not _installed(r)]
    if any(wheels.glob("flash_attn-*.whl")) and not _installed("flash-attn"):
        missing.append("flash-attn")
    if not missing:
        print(f"wheels: nothing to install from {wheels}", flush=True)
        return
    print(f"wheels: installing {', '.join(missing)} from {wheels}", flush=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links"]
    subprocess.run([*command, str(wheels), *missing], check=True)
    importlib.invalidate_caches()


# ------------------------------------------------------------------ 2. the CUDA tests


# One line per test with pytest -v: "tests/...::name[param] PASSED [ 12%]" (an id may hold spaces).
_OUTCOME = re.compile(r"^(\S+::.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def summarize_stopped_run(lines: list[str], timeout: float) -> tuple[str, bool]:
    """What a test run stopped at ``timeout`` got through: counts by outcome, failures named;
    and whether that passes: something passed and nothing failed (a run that finished no test
    may have hung in its first)."""
    counts: dict[str, int] = {}
    failed = []
    for line in lines:
        match = _OUTCOME.match(line)
        if match is None:
            continue
        outcome = match.group(2).lower()
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome in ("failed", "error"):
            failed.append(match.group(1))
    done = ", ".join(f"{n} {outcome}" for outcome, n in counts.items()) or "no test finished"
    summary = f"stopped after {timeout:g} s: {done}"
    if failed:
        summary += f" ({', '.join(failed)})"
    return summary, counts.get("passed", 0) > 0 and not failed


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended as the limit came
        os.killpg(process.pid, signal.SIGKILL)


def run_tests(
    files: tuple[str, ...], markers: str | None, dry_run: bool, per_test_timeout: float,
    timeout: float, stopped_may_pass: bool = False,
) -> tuple[str, bool]:  # fmt: skip
    """(pytest's summary line, whether it passed). The dry run only collects the tests.

    pytest's output is streamed as it comes (a lent machine's call can end mid-run; what was
    printed by then is what comes back), one line per test. A test that hangs (a graph capture
    waiting on a stream, say) is stopped after ``per_test_timeout`` seconds and the whole run
    after ``timeout``, so the measurement still runs. A run stopped so has not passed, unless
    ``stopped_may_pass`` (a time-boxed sample of a longer file) and some test passed, none failed.
    """
    files = [f for f in files if Path(f).is_file()]
    if not files:
        return "not run: no tests/ in the current directory (run from a checkout)", True
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    if markers is not None:
        command += ["-m", markers]
    if dry_run:
        command += ["-q", "--collect-only", *files]
    else:
        if importlib.util.find_spec("pytest_timeout") is not None:
            command += [f"--timeout={per_test_timeout:g}"]
        command += ["-v", "-rs", *files]
    env = os.environ | {"CONVEYOR_TEST_DEVICE": "cpu" if dry_run else "cuda"}
    print(f"tests: {' '.join(command[1:])}", flush=True)
    # A process group of its own, so that the time limit also stops what the tests started
    # (helpers that hold the output pipe open would otherwise keep the read below waiting).
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timer = threading.Timer(timeout, _kill_group, (process,))
    timer.start()
    lines: list[str] = []
    try:
        for line in process.stdout:
            if line.strip():
                lines.append(line.rstrip())
            if not dry_run:
                print(line, end="", flush=True)
        returncode = process.wait()
    finally:
        timer.cancel()
    if returncode < 0:
        summary, passed = summarize_stopped_run(lines, timeout)
        return summary, passed and stopped_may_pass
    if returncode != 0 and dry_run:
        print("\n".join(lines[-40:]), flush=True)
    summary = lines[-1].strip("= ") if lines else f"pytest exited {returncode}"
    return summary, returncode == 0


# ------------------------------------------------------------------ 3 and 4. the model, the table


def _ints(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    return default if text is None else tuple(int(x) for x in text.split(","))


def make_plan(args: argparse.Namespace):
    from benchmarks.fixtures.model_maker import ensure_model
    from benchmarks.gpu_check.measure import CheckPlan

    if args.dry_run:
        return CheckPlan(
            model_dir=args.model or ensure_model("tiny", "qwen3"),
            device="cpu",
            dtype="float32",
            decode_batches=_ints(args.batches, (1, 16, 64, 256)),
            decode_context=args.context or 32,
            decode_steps=args.steps or 4,
            prefill_lens=_ints(args.prompts, (128, 512, 2048)),
            kv_cache_memory=128 << 20,
            attention_backend=args.attention_backend,
        )
    return CheckPlan(
        model_dir=args.model or ensure_model("qwen3-0.6b", "qwen3"),
        device="cuda",
        dtype="bfloat16",
        decode_batches=_ints(args.batches, (1, 16, 64, 256)),
        decode_context=args.context or 256,
        decode_steps=args.steps or 20,
        prefill_lens=_ints(args.prompts, (2048, 8192, 32768)),
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_backend=args.attention_backend,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.wheels is not None:
        install_from_wheels(args.wheels)
    from benchmarks.fixtures.model_maker import model_cache_dir
    from conveyor.runtime.logs import configure_logging

    configure_logging("gpu-check")
    # The tests and the measurement share one generated model (pytest would use its own cache).
    os.environ.setdefault("CONVEYOR_CACHE", str(model_cache_dir()))
    tests, passed = ("skipped (--skip-tests)", True)
    if not args.skip_tests:
        tests, passed = run_tests(
            CUDA_TEST_FILES, CUDA_MARKERS, args.dry_run, args.test_timeout, args.tests_timeout
        )
    # The parity file takes longer than a lent machine's call leaves it: what runs in its time
    # is the sample, and it passes if that does.
    parity, parity_passed = ("skipped (--skip-parity)", True)
    if not args.skip_parity:
        parity, parity_passed = run_tests(
            PARITY_TEST_FILES, None, args.dry_run, args.test_timeout, args.parity_timeout, True
        )
    from benchmarks.gpu_check.measure import format_report, measure, report_as_dict

    plan = make_plan(args)
    report = measure(plan)
    report.tests = tests
    report.parity = parity
    if args.compare_backend:
        report.comparison = measure(
            dataclasses.replace(plan, attention_backend=args.compare_backend)
        )
    workloads = args.offline
    requests = args.offline_requests or (8 if args.dry_run else 256)
    report.offline = [run_offline(plan, w, requests) for w in workloads]
    if not args.skip_sweep:
        report.attention_sweeps = {
            phase: run_attention_sweep(plan, phase, args.dry_run, args.sweep_timeout)
            for phase in SWEEP_CONFIGS
        }
    print(format_report(report), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report_as_dict(report), indent=2) + "\n")
    return 0 if passed and parity_passed else 1


def run_offline(plan, workload: str, num_requests: int) -> dict:
    """``conveyor bench offline`` (the multi-process engine) on the measured model, in a child
    process: its JSON, or what went wrong."""
    command = [sys.executable, "-m", "conveyor.entrypoints.cli", "bench", "offline", "--json"]
    command += ["--model", str(plan.model_dir), "--device", plan.device, "--dtype", plan.dtype]
    command += ["--workload", workload, "--num-requests", str(num_requests)]
    command += ["--max-num-seqs", str(num_requests), "--attention-backend", plan.attention_backend]
    command += ["--max-num-batched-tokens", "8192"]
    if plan.kv_cache_memory is not None:
        command += ["--kv-cache-memory", str(plan.kv_cache_memory)]
    print(f"offline: {' '.join(command[3:])}", flush=True)
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        return {"workload": workload, "error": (result.stderr or result.stdout)[-500:]}
    return json.loads(lines[-1])


def attention_sweep_command(plan, phase: str, dry_run: bool) -> list[str]:
    """``python -m benchmarks attention --triton-configs`` on the measured model's attention shape:
    decode steps (its default scenarios) or prompt chunks of 2k and 8k after 0 and 8k cached
    tokens; in a dry run one small chunk each, one config, one timed call."""
    config = json.loads((plan.model_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    command = [sys.executable, "-m", "benchmarks", "attention"]
    command += ["--device", plan.device, "--dtype", plan.dtype, "--backend", "triton"]
    command += ["--num-heads", str(heads), "--num-kv-heads", str(kv_heads)]
    command += ["--head-dim", str(head_dim), "--hidden-size", str(config["hidden_size"])]
    command += ["--intermediate-size", str(config["intermediate_size"])]
    if dry_run:
        chunk = "1" if phase == "decode" else "24"
        command += ["--chunk-lens", chunk, "--contexts", "40", "--rounds", "1", "--repeats", "1"]
        return [*command, "--triton-configs", "16x32"]
    if phase == "prefill":
        command += ["--chunk-lens", "2048,8192", "--contexts", "0,8192"]
    return [*command, "--triton-configs", SWEEP_CONFIGS[phase]]


def run_attention_sweep(plan, phase: str, dry_run: bool, timeout_s: float) -> str:
    """The sweep's table (bench attention's lines from its header on), or what went wrong. A
    dry run on the CPU runs the kernel in Triton's interpreter."""
    command = attention_sweep_command(plan, phase, dry_run)
    print(f"sweep: {' '.join(command[3:])}", flush=True)
    env = dict(os.environ)
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"failed: still running after {timeout_s:g} s (--sweep-timeout)"
    lines = result.stdout.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith("scenario")), None)
    if result.returncode != 0 or header is None:
        return "failed: " + (result.stderr or result.stdout)[-500:].strip()
    return "\n".join([lines[header - 1], *lines[header:]])


if __name__ == "__main__":
    sys.exit(main())
