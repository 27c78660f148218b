"""The measurements of ``python -m benchmarks gpu-check``: decode and prefill speed of one worker, as a table.

Runs in the process of ``python -m benchmarks gpu-check`` (benchmarks/gpu_check/check.py), after the CUDA tests.
Decode: a batch of requests with ``context`` tokens each, the mean step time with CUDA graphs and
eagerly, the launches the host makes per step, and the step time against the weight-read limit
(a decode step must read every weight once: weight bytes / memory bandwidth, the bandwidth
measured by a device-to-device copy). Prefill: one prompt per step, whole. On CPU (``--dry-run``)
the same code runs with small shapes, and what only CUDA has is "n/a".
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.step_driver import StepDriver, count_launches
from conveyor.frontend.engine_args import EngineArgs
from conveyor.worker.layers import triton_ops
from conveyor.worker.worker import Worker

WARMUP_STEPS = 3


@dataclass(frozen=True)
class CheckPlan:
    model_dir: Path
    device: str
    dtype: str
    decode_batches: tuple[int, ...]
    decode_context: int
    decode_steps: int
    prefill_lens: tuple[int, ...]
    # CUDA only; None: the engine's default.
    gpu_memory_utilization: float | None = None
    # The KV cache's bytes; None: the engine's default (1 GiB on CPU, on CUDA what
    # gpu_memory_utilization leaves after profiling).
    kv_cache_memory: int | None = None
    attention_backend: str = "auto"


@dataclass
class DecodeRow:
    batch: int
    eager_s: float
    graphs_s: float | None = None
    eager_launches: int | None = None
    graphs_launches: int | None = None


@dataclass
class PrefillRow:
    prompt_len: int
    seconds: float


@dataclass
class CheckReport:
    device_name: str
    torch_version: str
    dtype: str
    attention_backend: str
    block_size: int
    num_params: int
    weight_bytes: int
    bandwidth: float  # bytes per second, measured
    decode_context: int
    decode: list[DecodeRow] = field(default_factory=list)
    prefill: list[PrefillRow] = field(default_factory=list)
    peak_memory: int | None = None
    kv_cache_bytes: int = 0
    # What ran the small ops between the matmuls: "triton" or "torch" (and why).
    token_ops: str = "torch"
    # K and V of one token in every layer: what a decode reads per context token.
    kv_bytes_per_token: int = 0
    graph_bytes: int | None = None
    # What the memory profile set aside for them (whole graphs: measured on its stand-in cache).
    profiled_graph_bytes: int | None = None
    tests: str = "not run"
    # The parity tests against transformers with the engines on CUDA (test_parity_hf.py).
    parity: str = "not run"
    # The same measurement with another attention backend (gpu-check --compare-backend).
    comparison: CheckReport | None = None
    # bench offline's JSON per workload, or {"workload": ..., "error": ...}.
    offline: list[dict] = field(default_factory=list)
    # bench attention --triton-configs per kind of step ("decode", "prefill"): its table.
    attention_sweeps: dict[str, str] = field(default_factory=dict)

    @property
    def weight_read_s(self) -> float:
        return self.weight_bytes / self.bandwidth

    def read_limit_s(self, batch: int) -> float:
        """The least time a decode step of ``batch`` requests can take: reading the weights
        once and every request's context K/V (from batch 64 at 256 tokens on, Qwen3-0.6B's K/V
        outweighs its weights)."""
        kv_bytes = batch * self.decode_context * self.kv_bytes_per_token
        return (self.weight_bytes + kv_bytes) / self.bandwidth


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    size = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    repeats = 10 if device.type == "cuda" else 3
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * size * repeats / (time.perf_counter() - start)


def _decode_room(plan: CheckPlan) -> int:
    """Tokens a decode request grows by: warm-ups, timed steps and launch counts, both modes."""
    return 2 * (WARMUP_STEPS + plan.decode_steps + 1) + 8


def _start_worker(plan: CheckPlan) -> tuple[Worker, int]:
    longest = max(max(plan.prefill_lens), plan.decode_context + _decode_room(plan))
    # Every prefill in one step; the decode batches' prompts go in as many as fit.
    budget = max(*plan.prefill_lens, plan.decode_context, *plan.decode_batches)
    args = EngineArgs(
        model=str(plan.model_dir),
        device=plan.device,
        dtype=plan.dtype,
        max_num_seqs=max(plan.decode_batches),
        max_num_batched_tokens=budget,
        max_model_len=longest + 1,
        gpu_memory_utilization=plan.gpu_memory_utilization,
        kv_cache_memory=plan.kv_cache_memory,
        attention_backend=plan.attention_backend,
    )
    worker = Worker(args.create_engine_config())
    num_blocks = worker.determine_num_blocks()
    worker.initialize_cache(num_blocks)
    return worker, num_blocks


def _time_decode(driver: StepDriver, batch: int, plan: CheckPlan) -> DecodeRow:
    runner = driver.worker.runner
    req_ids = driver.start(batch, plan.decode_context, _decode_room(plan))

    def steps():
        driver.decode(req_ids)

    graphs = runner.decode_graphs
    row = DecodeRow(batch=batch, eager_s=0.0)
    if graphs is not None:
        for _ in range(WARMUP_STEPS):
            steps()
        row.graphs_s = driver.timed(steps, plan.decode_steps)
        row.graphs_launches = count_launches(steps, driver.device)
    runner.decode_graphs = None  # eager for the comparison, same requests
    try:
        for _ in range(WARMUP_STEPS):
            steps()
        row.eager_s = driver.timed(steps, plan.decode_steps)
        row.eager_launches = count_launches(steps, driver.device)
    finally:
        runner.decode_graphs = graphs
    driver.finish(req_ids)
    return row


def _prefill_once(driver: StepDriver, prompt_len: int) -> float:
    started: list[int] = []
    seconds = driver.timed(lambda: started.extend(driver.start(1, prompt_len, 1)))
    driver.finish(started)
    return seconds


def _time_prefill(driver: StepDriver, prompt_len: int) -> PrefillRow:
    # The better of two: the first run of a shape also picks kernels and grows allocator pools.
    seconds = min(_prefill_once(driver, prompt_len) for _ in range(2))
    return PrefillRow(prompt_len=prompt_len, seconds=seconds)


def measure(plan: CheckPlan) -> CheckReport:
    # Before the worker takes gpu_memory_utilization of the card, and out of its peak.
    bandwidth = copy_bandwidth(torch.device(plan.device))
    if plan.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    worker, num_blocks = _start_worker(plan)
    runner = worker.runner
    device = worker.device
    params = list(runner.model.parameters())
    report = CheckReport(
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        torch_version=torch.__version__,
        dtype=str(runner.dtype).removeprefix("torch."),
        attention_backend=runner.backend.name,
        block_size=runner.block_size,
        num_params=sum(p.numel() for p in params),
        weight_bytes=sum(p.numel() * p.element_size() for p in params),
        bandwidth=bandwidth,
        decode_context=plan.decode_context,
        kv_cache_bytes=num_blocks * runner.bytes_per_block(),
        kv_bytes_per_token=runner.bytes_per_block() // runner.block_size,
        graph_bytes=runner.cuda_graph_bytes if device.type == "cuda" else None,
        profiled_graph_bytes=runner.profiled_graph_bytes if device.type == "cuda" else None,
    )
    driver = StepDriver(worker, num_blocks, runner.vocab_size)
    with torch.inference_mode():
        for batch in plan.decode_batches:
            report.decode.append(_time_decode(driver, batch, plan))
        for prompt_len in plan.prefill_lens:
            report.prefill.append(_time_prefill(driver, prompt_len))
    if device.type == "cuda":
        report.peak_memory = torch.cuda.max_memory_allocated(device)
    report.token_ops = _token_ops(device)
    worker.shutdown()
    return report


def _token_ops(device: torch.device) -> str:
    """After the measurement: whether the Triton token ops ran it (worker/layers/triton_ops.py)."""
    if device.type != "cuda":
        return "torch (CPU: its compiled ops where built)"
    if not triton_ops.triton_ops_enabled():
        return "torch (Triton does not import, or CONVEYOR_TRITON_OPS=0)"
    if triton_ops.failure is not None:
        return f"torch (a Triton launch failed: {triton_ops.failure})"
    return "triton"


def report_as_dict(report: CheckReport) -> dict:
    limits = {str(row.batch): report.read_limit_s(row.batch) for row in report.decode}
    return dataclasses.asdict(report) | {
        "weight_read_s": report.weight_read_s,
        "read_limit_s": limits,
    }


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f}"


def _rate(count: int, seconds: float | None) -> str:
    return "n/a" if not seconds else f"{count / seconds:,.0f}"


def _count(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _gib(num_bytes: int | None) -> str:
    return "n/a" if num_bytes is None else f"{num_bytes / (1 << 30):.2f} GiB"


def format_report(report: CheckReport) -> str:
    """The table gpu-check prints (Markdown, so it can go to docs/performance.md as it is)."""
    lines = _format_measurement(report)
    if report.comparison is not None:
        lines += [
            "",
            f"With attention backend {report.comparison.attention_backend}, same process:",
        ]
        lines += _format_measurement(report.comparison)[3:]
    if report.offline:
        lines += ["", "| offline workload | requests | output tok/s | total tok/s | seconds |"]
        lines.append("|---|---|---|---|---|")
        for run in report.offline:
            if "error" in run:
                lines.append(f"| {run['workload']} | failed: {run['error'][-200:]!r} | | | |")
                continue
            lines.append(
                f"| {run['workload']} | {run['num_requests']} | {run['output_tok_s']:,.0f} "
                f"| {run['total_tok_s']:,.0f} | {run['seconds']:.2f} |"
            )
    for phase, table in report.attention_sweeps.items():
        lines += ["", f"Triton attention tile shapes, {phase} (bench attention --triton-configs):"]
        lines.append(table)
    lines += [
        "",
        f"peak GPU memory: {_gib(report.peak_memory)} (KV cache {_gib(report.kv_cache_bytes)}, "
        f"CUDA graphs {_gib(report.graph_bytes)}; the memory profile set aside "
        f"{_gib(report.profiled_graph_bytes)} for them)",
        f"CUDA tests: {report.tests}",
        f"parity with transformers on CUDA: {report.parity}",
    ]
    return "\n".join(lines)


def _format_measurement(report: CheckReport) -> list[str]:
    """The header lines, the decode table and the prefill table of one measurement."""
    per_request = report.decode_context * report.kv_bytes_per_token / report.bandwidth
    lines = [
        f"device: {report.device_name} (torch {report.torch_version}), {report.dtype}, "
        f"attention backend {report.attention_backend}, block size {report.block_size}, "
        f"token ops {report.token_ops}",
        f"model: {report.num_params / 1e6:,.1f} M parameters, {report.weight_bytes / 1e6:,.1f} MB "
        f"of weights; copy bandwidth {report.bandwidth / 1e9:,.0f} GB/s, so a decode step's "
        f"read limit is {report.weight_read_s * 1e3:.3f} ms for the weights plus "
        f"{per_request * 1e6:.2f} us per request for its context's K/V",
        f"decode: {report.decode_context} context tokens per request; prefill: one prompt, one step",
        "",
        "| batch | graphs ms/step | graphs tok/s | eager ms/step | eager tok/s | graphs speedup "
        "| read limit ms | best / read limit | launches/step eager | launches/step graphs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report.decode:
        best = min(s for s in (row.graphs_s, row.eager_s) if s is not None)
        speedup = "n/a" if row.graphs_s is None else f"{row.eager_s / row.graphs_s:.2f}x"
        limit = report.read_limit_s(row.batch)
        lines.append(
            f"| {row.batch} | {_ms(row.graphs_s)} | {_rate(row.batch, row.graphs_s)} "
            f"| {_ms(row.eager_s)} | {_rate(row.batch, row.eager_s)} | {speedup} "
            f"| {limit * 1e3:.3f} | {best / limit:.1f}x | {_count(row.eager_launches)} "
            f"| {_count(row.graphs_launches)} |"
        )
    lines += ["", "| prompt tokens | prefill ms | prefill tok/s |", "|---|---|---|"]
    for row in report.prefill:
        lines.append(
            f"| {row.prompt_len} | {_ms(row.seconds)} | {_rate(row.prompt_len, row.seconds)} |"
        )
    return lines
