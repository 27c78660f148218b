"""The ``mix`` workload beside llama.cpp's server: ``llama-server`` on a Q4_0 GGUF and ``conveyor
serve`` (int4 by default) on the same random-weight model, the same requests from conveyor's load
generator, interleaved round by round.

    python -m benchmarks llama-cpp-serve --llama-cpp-dir PATH/llama.cpp [--build-dir PATH/build]
        [--size qwen3-0.6b] [--workload mix] [--num-requests 64] [--rounds 2] [--cores N]
        [--formats int4]

Runs in the process the developer starts. The llama.cpp tree is the ``llama-cpp`` benchmark's
(same GGUF, made the same way), with ``llama-server`` built beside its other tools. The requests
are ``conveyor bench offline``'s workload shapes (``mix``: 32 prompt tokens and 32 generated,
then 512 and 128, alternating), random token ids sent as ids, greedy, every output to its full
length (``ignore_eos``), all at once. Both servers run ``--num-requests`` sequences at a time
(llama-server: as many slots, each with room for the longest request; conveyor:
``--max-num-seqs`` and ``--kv-cache-memory``, 6 GiB by default: room for every request at once,
as llama-server's slots have) and are up for the whole run (each format a server of its own, its
weights and KV cache held at once: several formats need that memory each); each round sends the
workload once to each, one after the other.
Reports, per engine, the best round's output tok/s (the load generator's, prefill included:
what a client sees) and that round's median time to first token and per-token time.
``--cores N`` pins this process and both servers (their processes inherit it) to N cores;
llama-server gets ``-t N``.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from benchmarks.llama_cpp import common_parser, ensure_q4_0, find_llama_cpp, pin_cores
from benchmarks.soak.soak import free_port, run_loadgen, start_server
from conveyor.bench.offline import WORKLOADS


def write_requests(path: Path, workload: str, count: int, vocab_size: int) -> tuple[int, int]:
    """``count`` requests of the workload's shapes in turn, as the load generator's jsonl; the
    longest prompt and output."""
    shapes = WORKLOADS[workload]
    rng = np.random.default_rng(0)
    with path.open("w") as out:
        for i in range(count):
            prompt_len, output_len = shapes[i % len(shapes)]
            prompt = rng.integers(10, vocab_size, prompt_len).tolist()
            out.write(json.dumps({"prompt": prompt, "max_tokens": output_len}) + "\n")
    return max(p for p, _ in shapes), max(o for _, o in shapes)


def start_llama_server(
    binary: Path, gguf: Path, slots: int, slot_tokens: int, threads: int, log: Path
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        str(binary), "-m", str(gguf), "-t", str(threads), "-np", str(slots),
        "-c", str(slots * slot_tokens), "-b", "2048", "-ub", "512",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}"


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5.0)


def main(argv: list[str] | None = None) -> int:
    parser = common_parser(__doc__.split("\n")[0], "int4")
    parser.add_argument("--workload", default="mix", choices=sorted(WORKLOADS))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="6G", help="conveyor serve's KV cache")
    parser.add_argument("--work-dir", help="logs and reports (default: a new temporary folder)")
    args = parser.parse_args(argv)
    llama, why_not = find_llama_cpp(args.llama_cpp_dir, args.build_dir)
    server_binary = llama.bin_dir / "llama-server" if llama else None
    if llama is not None and not server_binary.is_file():
        llama, why_not = None, f"{server_binary} not found (build llama-server)"
    if llama is None:
        print(f"llama-cpp-serve: skipped: {why_not}")
        return 0
    from benchmarks.fixtures.model_maker import ensure_model
    from conveyor.bench.machine import machine_info

    cores = pin_cores(args.cores)
    model_dir = ensure_model(args.size, "qwen3")
    gguf = ensure_q4_0(model_dir, llama)
    config = json.loads((model_dir / "config.json").read_text())
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="conveyor-llama-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    requests = work / "requests.jsonl"
    longest_prompt, longest_output = write_requests(
        requests, args.workload, args.num_requests, config["vocab_size"]
    )
    flags = [
        "--dataset", "jsonl", "--dataset-path", str(requests), "--num-prompts",
        str(args.num_requests), "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
    ]  # fmt: skip
    servers: dict[str, SimpleNamespace] = {}
    llama_process = None
    try:
        llama_process, url = start_llama_server(
            server_binary, gguf, args.num_requests, longest_prompt + longest_output + 16,
            len(cores), work / "llama-server.log",
        )  # fmt: skip
        servers["llama.cpp Q4_0"] = SimpleNamespace(base_url=url, stop=lambda: None)
        for name in args.formats.split(","):
            serve_args = [
                "--max-num-seqs", str(args.num_requests), "--max-num-batched-tokens", "2048",
                "--kv-cache-memory", args.kv_cache_memory,
                *([] if name == "float32" else ["--quantization", name]),
            ]  # fmt: skip
            options = SimpleNamespace(frontends=1, port=0, serve_args=" ".join(serve_args))
            servers[name] = start_server(options, str(model_dir), work / f"{name}.log", 600.0)
        results: dict[str, list[dict]] = {name: [] for name in servers}
        for round_ in range(args.rounds):
            for name, server in servers.items():
                out = work / f"{name.split()[0]}-{round_}.json"
                started = time.monotonic()
                result = run_loadgen(server, str(model_dir), out, flags, timeout_s=1800)
                if result["failed"]:
                    raise RuntimeError(f"{name}: {result['failed']} requests failed; see {out}")
                results[name].append(result)
                print(f"round {round_ + 1} {name}: {result['output_throughput']:.1f} output "
                      f"tok/s ({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip
    finally:
        for server in servers.values():
            server.stop()
        if llama_process is not None:
            stop(llama_process)
    report(args, cores, machine_info(), results, work)
    return 0


def report(args, cores, machine, results, work: Path) -> None:
    print("machine:", ", ".join(f"{k}={v}" for k, v in machine.items()))
    print(f"cores {cores}; {args.size}, workload {args.workload}, {args.num_requests} requests at "
          f"once, best of {args.rounds} interleaved rounds; files in {work}")  # fmt: skip
    best = {name: max(runs, key=lambda r: r["output_throughput"]) for name, runs in results.items()}
    base = best["llama.cpp Q4_0"]["output_throughput"]
    print(f"{'engine':>15} {'output tok/s':>12} {'vs llama':>8} {'median TTFT ms':>14} "
          f"{'median TPOT ms':>14}")  # fmt: skip
    for name, result in best.items():
        print(
            f"{name:>15} {result['output_throughput']:12.1f} "
            f"{result['output_throughput'] / base:8.2f} {result['median_ttft_ms']:14.1f} "
            f"{result['median_tpot_ms']:14.1f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
