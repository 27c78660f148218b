"""``python -m benchmarks``: the lab's commands, run from a checkout (never installed).

    python -m benchmarks attention|layers|moe|wire|scheduler|...   micro-benchmarks of the engine
    python -m benchmarks reference ...                              conveyor against vLLM's CPU build
    python -m benchmarks policy-study|soak|scaleout ...             studies, soak runs, simulators
    python -m benchmarks gpu-check [--dry-run]                      CUDA tests and a speed table
    python -m benchmarks make-model OUT                             a random-weight test model

Runs in the process the developer starts, from the repository's root (the lab imports the
installed ``conveyor`` package and its own modules from the checkout). The product's own
benchmarks are installed: ``conveyor bench serve|offline``.
"""

import sys

from conveyor.entrypoints.cli import Command, CommandTable, build_parser, dispatch

COMMANDS: CommandTable = {
    "attention": Command("benchmarks.attention", "attention against matmul time per layer"),
    "layers": Command("benchmarks.layers", "the model's token-wise ops on CPU"),
    "moe": Command("benchmarks.moe", "ways to run a mixture-of-experts layer's experts on CPU"),
    "quantized-decode": Command(
        "benchmarks.quantized_decode", "batch-1 decode, float32 against int8 and int4, CPU"
    ),
    "llama-cpp": Command(
        "benchmarks.llama_cpp", "decode beside llama.cpp's Q4_0: int4, int8, float32, CPU"
    ),
    "llama-cpp-serve": Command(
        "benchmarks.llama_cpp_serve", "the mix workload through llama-server and conveyor serve"
    ),
    "quant-gemm": Command(
        "benchmarks.quant_gemm", "quantized linears on CUDA: Triton kernel, torch path, bf16"
    ),
    "wire": Command("benchmarks.wire", "bytes per step of the engine -> worker diff"),
    "scheduler": Command("benchmarks.scheduler", "the scheduler's cost per step, no model"),
    "step-budget": Command("benchmarks.step_budget", "what a TBT SLO adds to schedule(), no model"),
    "router": Command("benchmarks.router", "the data-parallel router's cost per request"),
    "tokenize": Command(
        "benchmarks.tokenize", "tokenizing on the event loop, in threads or in processes"
    ),
    "structured": Command(
        "benchmarks.structured", "output tok/s with and without a JSON-schema constraint"
    ),
    "lora": Command(
        "benchmarks.lora", "output tok/s of a batch over 1, 4, 16 LoRA adapters vs the base"
    ),
    "lora-kernel": Command(
        "benchmarks.lora_kernel", "a layer's LoRA correction: grouped kernel, torch loop, base"
    ),
    "metrics": Command(
        "benchmarks.metrics_cost", "output tok/s through the server with metrics on and off"
    ),
    "stack-profile": Command(
        "benchmarks.stack_profile", "per-op share of a worker's forward pass from a py-spy file"
    ),
    "reference": Command(
        "benchmarks.reference", "conveyor against vLLM's CPU build, interleaved, ratios"
    ),
    "scaleout": Command(
        "benchmarks.scaleout.cli", "1 to 16 simulated engines behind the router, per policy"
    ),
    "policy-study": Command(
        "benchmarks.policy_study.study", "the four scheduling policies under the same load"
    ),
    "soak": Command("benchmarks.soak.soak", "a server at 70 % of its capacity, watched for leaks"),
    "dashboard": Command(
        "benchmarks.observability.capture", "the Grafana dashboard under load, with Prometheus"
    ),
    "gpu-check": Command(
        "benchmarks.gpu_check.check", "on a GPU machine: CUDA tests, then a decode/prefill table"
    ),
    "make-model": Command(
        "benchmarks.fixtures.make_model", "a random-weight test model in Hugging Face format"
    ),
    "make-draft-pair": Command(
        "benchmarks.fixtures.draft_pair", "a weight-bound target the default model drafts for"
    ),
    "fake-server": Command(
        "conveyor.bench.loadgen.fake_server", "an OpenAI-compatible server with set delays"
    ),
}


def main(argv: list[str] | None = None) -> int:
    description = "conveyor's lab: micro-benchmarks, studies, the GPU check, test models."
    return dispatch(build_parser("python -m benchmarks", COMMANDS, description), COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
