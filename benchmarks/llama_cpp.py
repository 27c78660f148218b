"""Decode on CPU beside llama.cpp: conveyor's int4, int8 and float32 against a Q4_0 GGUF of the
same weights, at the same batch sizes, interleaved in one run.

    python -m benchmarks llama-cpp --llama-cpp-dir PATH/llama.cpp [--build-dir PATH/build]
        [--size qwen3-0.6b] [--batches 1,8,64] [--prompt-len 16] [--output-len 32]
        [--rounds 2] [--cores N] [--formats int4,int8,float32]

Runs in the process the developer starts. ``--llama-cpp-dir`` is a llama.cpp source tree (the
``llama-cpp-python`` sdist's ``vendor/llama.cpp`` will do) with ``llama-batched-bench`` and
``llama-quantize`` built under ``--build-dir`` (default ``<dir>/build``); without it the command
says so and does nothing. The random-weight model of ``--size`` is converted to a float32 GGUF by
the tree's own ``convert_hf_to_gguf.py`` and quantized to Q4_0 by ``llama-quantize``, once (cached
beside the model). The random model's tokenizer is no tokenizer the converter knows, so it is
told the pre-tokenizer is Qwen2's: only token ids go in, so the vocabulary's text is moot.

Each round, for each batch size B: ``llama-batched-bench`` runs B sequences of ``--prompt-len``
prompt tokens and ``--output-len`` generated ones (its decode rate, ``speed_tg``, is B x
output-len over the generation phase), then each conveyor format (an in-process engine, loaded
once) generates the same shapes twice, ``--output-len`` tokens and one: the difference is the
decode phase, so both engines' rates leave prefill out. The best rate of the rounds is kept.
Batch 1 also gives each engine's step time against its weight-read time: the bytes a decode
step reads (every GGUF tensor, the tied embedding being the output matrix; conveyor's as the
``quantized-decode`` benchmark counts them) over the host's read bandwidth, measured by torch.mv
over a 1 GiB float32 matrix each round (the best of the rounds). ``--cores N`` pins this process, its engines and llama.cpp to N of
the cores (llama.cpp gets ``-t N``; conveyor's worker uses the cores it may run on).

``--llama-no-repack`` passes ``-nr``: llama.cpp then keeps Q4_0 in its plain layout instead of
repacking it for its batched kernels. A build with ``GGML_NATIVE=ON`` on an AMX host takes the AMX
path for batches, which segfaulted in ``ggml_backend_amx_mul_mat`` on the host this was written
on; a build with the AMX options off (``GGML_NATIVE=OFF``, AVX-512 on) repacks without it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CONVERT_WITH_QWEN2_PRE_TOKENIZER = """
import runpy, sys
tree = sys.argv[1]
sys.path[:0] = [tree, tree + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = [tree + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@dataclass(frozen=True)
class LlamaCpp:
    tree: Path
    bin_dir: Path

    @property
    def batched_bench(self) -> Path:
        return self.bin_dir / "llama-batched-bench"

    @property
    def quantize(self) -> Path:
        return self.bin_dir / "llama-quantize"


def find_llama_cpp(tree: str | None, build_dir: str | None) -> tuple[LlamaCpp | None, str]:
    """The llama.cpp tree and binaries, or None and why not."""
    if not tree:
        return None, "no llama.cpp given (--llama-cpp-dir)"
    found = LlamaCpp(Path(tree), Path(build_dir or Path(tree) / "build") / "bin")
    for needed in (found.tree / "convert_hf_to_gguf.py", found.batched_bench, found.quantize):
        if not needed.is_file():
            return None, f"{needed} not found (build llama-batched-bench and llama-quantize)"
    return found, ""


def ensure_q4_0(model_dir: Path, llama: LlamaCpp) -> Path:
    """The Q4_0 GGUF of ``model_dir`` (converted, then quantized), made once."""
    out = model_dir.parent / f"{model_dir.name}-q4_0.gguf"
    if out.is_file():
        return out
    f32 = out.with_name(f"{model_dir.name}-f32.gguf.tmp")
    convert = [sys.executable, "-c", CONVERT_WITH_QWEN2_PRE_TOKENIZER, str(llama.tree)]
    args = [str(model_dir), "--outtype", "f32", "--outfile", str(f32)]
    subprocess.run([*convert, *args], check=True, capture_output=True)
    tmp = out.with_name(out.name + ".tmp")
    subprocess.run(
        [str(llama.quantize), str(f32), str(tmp), "Q4_0"], check=True, capture_output=True
    )
    f32.unlink()
    os.rename(tmp, out)
    return out


def gguf_bytes(path: Path, llama: LlamaCpp) -> int:
    """Every tensor's bytes in the file: what a decode step reads (the tied embedding is the
    output matrix, read whole; its lookup of one row is noise). Read by the tree's own gguf
    package, in a child process, as the converter runs."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from gguf import GGUFReader; "
        "print(sum(int(t.n_bytes) for t in GGUFReader(sys.argv[2]).tensors))"
    )
    command = [sys.executable, "-c", script, str(llama.tree / "gguf-py"), str(path)]
    return int(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


def llama_decode_rate(
    llama: LlamaCpp,
    gguf: Path,
    batch: int,
    prompt_len: int,
    output_len: int,
    threads: int,
    repack: bool = True,
) -> float:
    """llama-batched-bench's decode tokens per second for ``batch`` sequences."""
    context = batch * (prompt_len + output_len) + 256
    command = [
        str(llama.batched_bench), "-m", str(gguf), "-c", str(context), "-npp", str(prompt_len),
        "-ntg", str(output_len), "-npl", str(batch), "-t", str(threads),
        "--output-format", "jsonl", *([] if repack else ["-nr"]),
    ]  # fmt: skip
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return float(rows[-1]["speed_tg"])


def conveyor_decode_rate(llm, prompts: list[list[int]], output_len: int) -> float:
    """Decode tokens per second: the same prompts to ``output_len`` tokens and to one; the
    difference is ``output_len - 1`` decode steps of the whole batch."""
    from conveyor.protocol import SamplingParams

    def seconds(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    prefill = seconds(1)
    whole = seconds(output_len)
    return len(prompts) * (output_len - 1) / max(whole - prefill, 1e-9)


def pin_cores(count: int) -> list[int]:
    cores = sorted(os.sched_getaffinity(0))
    if count:
        cores = cores[:count]
        os.sched_setaffinity(0, cores)
    return cores


def common_parser(description: str, formats: str) -> argparse.ArgumentParser:
    """The options every llama.cpp comparison takes: the tree and its build, the model's size,
    rounds, cores and conveyor's weight formats."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--llama-cpp-dir", help="a llama.cpp source tree with its build")
    parser.add_argument("--build-dir", help="its CMake build folder (default <dir>/build)")
    parser.add_argument("--size", default="qwen3-0.6b")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cores", type=int, default=0, help="pin to this many cores (0: all)")
    parser.add_argument("--formats", default=formats, help="conveyor's, comma-separated")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = common_parser(__doc__.split("\n")[0], "int4,int8,float32")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    # Each engine's own; three engines stay loaded (a 1 GiB cache each was OOM-killed beside
    # other sessions on a 23 GB host). Batch 64 of 16 + 16 tokens needs about 0.5 GB.
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    parser.add_argument(
        "--llama-no-repack", action="store_true", help="llama.cpp without weight repacking (-nr)"
    )
    args = parser.parse_args(argv)
    llama, why_not = find_llama_cpp(args.llama_cpp_dir, args.build_dir)
    if llama is None:
        print(f"llama-cpp: skipped: {why_not}")
        return 0
    from benchmarks.fixtures.model_maker import ensure_model
    from benchmarks.quantized_decode import decode_bytes, read_bandwidth
    from conveyor.bench.machine import machine_info
    from conveyor.frontend import LLM

    cores = pin_cores(args.cores)
    batches = [int(b) for b in args.batches.split(",")]
    model_dir = ensure_model(args.size, "qwen3")
    gguf = ensure_q4_0(model_dir, llama)
    config = json.loads((model_dir / "config.json").read_text())
    rng = np.random.default_rng(0)
    prompts = rng.integers(10, config["vocab_size"], (max(batches), args.prompt_len)).tolist()
    engines = {}
    for name in args.formats.split(","):
        engines[name] = LLM(
            str(model_dir), engine="inprocess", device="cpu", dtype="float32",
            quantization=None if name == "float32" else name, max_num_seqs=max(batches),
            max_num_batched_tokens=max(2048, max(batches) * args.prompt_len),
            kv_cache_memory=args.kv_cache_mb << 20, enable_prefix_caching=False,
        )  # fmt: skip
        conveyor_decode_rate(engines[name], prompts[:1], 4)  # warm-up: kernels built
    best = {(e, b): 0.0 for e in ["llama.cpp Q4_0", *engines] for b in batches}
    bandwidth = 0.0
    for _ in range(args.rounds):
        # Measured each round between the engines: other processes' load moves it too.
        bandwidth = max(bandwidth, read_bandwidth())
        for batch in batches:
            rate = llama_decode_rate(
                llama, gguf, batch, args.prompt_len, args.output_len, len(cores),
                repack=not args.llama_no_repack,
            )  # fmt: skip
            best["llama.cpp Q4_0", batch] = max(best["llama.cpp Q4_0", batch], rate)
            for name, llm in engines.items():
                rate = conveyor_decode_rate(llm, prompts[:batch], args.output_len)
                best[name, batch] = max(best[name, batch], rate)
    weights = {"llama.cpp Q4_0": gguf_bytes(gguf, llama)}
    weights.update({name: decode_bytes(config, name) for name in engines})
    for llm in engines.values():
        llm.shutdown()
    report(args, cores, machine_info(), bandwidth, weights, best, batches)
    return 0


def report(args, cores, machine, bandwidth, weights, best, batches) -> None:
    llama = "llama.cpp Q4_0"
    print("machine:", ", ".join(f"{k}={v}" for k, v in machine.items()))
    print(f"cores {cores}; read bandwidth {bandwidth / 1e9:.1f} GB/s (torch.mv, 1 GiB float32, "
          "best of the rounds)")  # fmt: skip
    print(f"{args.size}: prompt {args.prompt_len}, output {args.output_len}, best of "
          f"{args.rounds} interleaved rounds; decode tok/s (prefill left out); llama.cpp "
          f"{'without' if args.llama_no_repack else 'with'} weight repacking")  # fmt: skip
    engines = list(weights)
    print(f"{'engine':>15} " + " ".join(f"{f'B={b} tok/s':>12} {'vs llama':>8}" for b in batches))
    for name in engines:
        cells = [f"{best[name, b]:12.1f} {best[name, b] / best[llama, b]:8.2f}" for b in batches]
        print(f"{name:>15} " + " ".join(cells))
    print(f"\nbatch 1: {'engine':>15} {'step ms':>8} {'weights MB':>11} {'read ms':>8} "
          f"{'step/read':>9}")  # fmt: skip
    for name in engines:
        step_ms = 1e3 / best[name, 1] if best.get((name, 1)) else float("nan")
        read_ms = weights[name] / bandwidth * 1e3
        print(
            f"         {name:>15} {step_ms:8.2f} {weights[name] / 1e6:11.1f} {read_ms:8.2f} "
            f"{step_ms / read_ms:9.2f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
