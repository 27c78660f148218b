"""Engine arguments as users pass them (keyword arguments or command-line flags) -> EngineConfig.

Runs in the frontend process (and in the ``conveyor`` commands). The one place where user-facing
knobs become the frozen ``EngineConfig`` tree; ``check_engine_config`` rejects combinations that
cannot run. No model means the embedded default: a small Qwen3 trained on the Python standard
library's source (``scripts/train_default_model.py``), shipped with the package.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from conveyor.frontend.model_source import resolve_model
from conveyor.frontend.tool_calls import PARSERS
from conveyor.protocol import (
    CacheConfig,
    EngineConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    check_engine_config,
    load_model_config,
)
from conveyor.protocol.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    POLICIES,
    QUANTIZATION_METHODS,
    ConfigError,
    NodeConfig,
    read_sampling_defaults,
)
from conveyor.runtime import cpu_isa
from conveyor.runtime.flags import finite_float, non_negative_float, positive_float

logger = logging.getLogger(__name__)

DEFAULT_TOKEN_BUDGET = 2048
# KV block sizes when the user names none: flash-attn 2's paged KV needs a multiple of 256 (the
# size nano-vllm uses); everywhere else small blocks waste less of each request's last block and
# share prefixes at a finer grain.
DEFAULT_BLOCK_SIZE = 16
FLASH_ATTN_BLOCK_SIZE = 256
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
# The default model's name in the HTTP API.
DEFAULT_SERVED_MODEL_NAME = "conveyor-tiny"


@dataclass
class EngineArgs:
    """Flat, user-facing engine knobs; ``model=None`` means the embedded default model."""

    # A local Hugging Face directory, or a Hugging Face id (cached, else downloaded).
    model: str | None = None
    # With an id: the branch, tag or commit of the snapshot (default: main).
    revision: str | None = None
    # With an id: the Hugging Face cache to find it in or download it to (None: HF_HUB_CACHE's).
    download_dir: str | None = None
    max_num_seqs: int = 256
    # None = 2048 for stall-free (prompts are chunked to fit); the whole-prompt policies
    # (prefill-first, orca, static) get max(2048, max_model_len) so every prompt fits in a step.
    max_num_batched_tokens: int | None = None
    # None: FLASH_ATTN_BLOCK_SIZE where flash-attn will run (CUDA, flash_attn installed), else
    # DEFAULT_BLOCK_SIZE.
    block_size: int | None = None
    # "auto", "flash-attn", "torch" or "cpu-kernel" (protocol.config.ATTENTION_BACKENDS).
    attention_backend: str = "auto"
    # On CUDA: no decode CUDA graphs, every step eager (slower; for debugging and comparison).
    enforce_eager: bool = False
    # Bytes of KV cache per worker; None: 1 GiB on CPU, on CUDA what gpu_memory_utilization leaves.
    kv_cache_memory: int | None = None
    # CUDA only (None: 0.9); a CPU engine refuses it rather than ignore it.
    gpu_memory_utilization: float | None = None
    # "auto": the model's dtype; "bfloat16": keys and values rounded to bfloat16 as they are cached.
    kv_cache_dtype: str = "auto"
    policy: str = "stall-free"
    enable_prefix_caching: bool = True
    # None = the model's own context length (max_position_embeddings).
    max_model_len: int | None = None
    dtype: str = "auto"
    # "int8": the decoder's linears and experts in int8, one scale per output row (CPU only).
    quantization: str | None = None
    device: str = "auto"
    seed: int = 0
    queue_order: str = "fcfs"
    long_prefill_token_threshold: int = 0
    tensor_parallel_size: int = 1
    # Tensor parallelism across hosts (protocol.config.NodeConfig): node 0 runs the engine, the
    # others `conveyor serve --headless`; every host listens or connects at master_addr.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    node_timeout_s: float = 10.0
    node_join_timeout_s: float = 300.0
    # Engine cores side by side (each with tensor_parallel_size workers and its own KV pool).
    data_parallel_size: int = 1
    async_scheduling: bool = False
    # None = no engine-wide queue cap; N = a request that finds N waiting is refused (HTTP 429).
    max_waiting_requests: int | None = None
    # The inter-token latency promised to clients (ms): each step sized from a step-cost model
    # learned online to stay under it while requests decode (stall-free only); None = off.
    tbt_slo_ms: float | None = None
    trace_steps: str | None = None
    enable_debug_queries: bool = False
    step_timeout_s: float = 600.0
    # The engine's stats line every this many seconds while it works (0 = never).
    stats_interval_s: float = 10.0
    # Sampling defaults: "auto" (the model's generation_config.json), "vllm" (none) or a folder.
    generation_config: str = "auto"
    # A Jinja chat template file replacing the tokenizer's own.
    chat_template: str | None = None
    # "hermes" or "llama3_json": the format of the model's tool calls (tool_choice "auto").
    tool_call_parser: str | None = None

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model directory and build the checked, frozen config tree."""
        model = str(DEFAULT_MODEL_DIR) if self.model is None else self.model
        model = resolve_model(model, self.revision, self.download_dir)
        model_config = load_model_config(model, self.dtype, self.max_model_len, self.seed)
        model_config = msgspec.structs.replace(
            model_config,
            sampling_defaults=read_sampling_defaults(self.generation_config, model_config.model),
            chat_template=self._read_chat_template(),
            tool_call_parser=self.tool_call_parser,
            quantization=self.quantization,
        )
        if model_config.sampling_defaults:
            logger.info(
                "sampling defaults from %s: %s (a request's own values win)",
                "the model's generation_config.json"
                if self.generation_config == "auto"
                else self.generation_config,
                model_config.sampling_defaults,
            )
        config = EngineConfig(
            model=model_config,
            cache=CacheConfig(
                block_size=self._block_size(),
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self._token_budget(model_config.max_model_len),
                max_num_seqs=self.max_num_seqs,
                max_model_len=model_config.max_model_len,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.policy,  # type: ignore[arg-type]
                queue_order=self.queue_order,  # type: ignore[arg-type]
                async_scheduling=self.async_scheduling,
                max_waiting_requests=self.max_waiting_requests,
                tbt_slo_ms=self.tbt_slo_ms,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                nodes=self._node_config(),
                data_parallel_size=self.data_parallel_size,
            ),
            observability=ObservabilityConfig(
                trace_steps=str(Path(self.trace_steps).resolve()) if self.trace_steps else None,
                debug_queries=self.enable_debug_queries,
                step_timeout_s=self.step_timeout_s,
                stats_interval_s=self.stats_interval_s,
            ),
            device=self._device(),
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
        )
        check_engine_config(config)
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ConfigError(
                f"tool_call_parser must be one of {', '.join(sorted(PARSERS))}, "
                f"got {self.tool_call_parser!r}"
            )
        try:  # read by the workers' kernel builds: a typo fails here, before any process starts
            cpu_isa.requested()
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return config

    def _node_config(self) -> NodeConfig:
        return NodeConfig(
            self.nnodes,
            self.node_rank,
            self.master_addr,
            self.master_port,
            self.node_timeout_s,
            self.node_join_timeout_s,
        )

    def _block_size(self) -> int:
        if self.block_size is not None:
            return self.block_size
        if self.attention_backend == "flash-attn" or (
            self.attention_backend == "auto" and _flash_attn_will_run(self._device())
        ):
            return FLASH_ATTN_BLOCK_SIZE
        return DEFAULT_BLOCK_SIZE

    def _device(self) -> str:
        """The device asked for; "auto" is the CPU when the weights are quantized, the one
        device that runs int8 weights, so a GPU host does not fail at load instead."""
        if self.device == "auto" and self.quantization is not None:
            return "cpu"
        return self.device

    def _read_chat_template(self) -> str | None:
        if self.chat_template is None:
            return None
        try:
            return Path(self.chat_template).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--chat-template {self.chat_template}: {exc}") from None

    def _token_budget(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.policy == "stall-free":
            return DEFAULT_TOKEN_BUDGET
        return max(DEFAULT_TOKEN_BUDGET, max_model_len)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineArgs:
        """Pick this class's fields out of a namespace filled by ``add_engine_args``."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


def _parse_bytes(text: str) -> int:
    """'1073741824', '512M', '2G' -> bytes (more than 0)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    suffix = text[-1:].upper()
    value = int(finite_float(text[:-1]) * units[suffix]) if suffix in units else int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per ``EngineArgs`` field, with the same defaults."""
    d = EngineArgs()
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=d.model,
        help="a Hugging Face model directory, or an id (org/name): from the Hugging Face cache, "
        "else downloaded from the Hub (default: the embedded model)",
    )
    group.add_argument(
        "--revision",
        default=d.revision,
        help="with an id: the snapshot's branch, tag or commit (default: main)",
    )
    group.add_argument(
        "--download-dir",
        default=d.download_dir,
        metavar="DIR",
        help="with an id: the Hugging Face cache to find it in or download it to (default: "
        "$HF_HUB_CACHE, else $HF_HOME/hub)",
    )
    group.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="token budget per step (default 2048; whole-prompt policies: max(2048, context))",
    )
    group.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        help=f"KV block size in tokens (default {FLASH_ATTN_BLOCK_SIZE} where flash-attn runs, "
        f"else {DEFAULT_BLOCK_SIZE})",
    )
    group.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default=d.attention_backend,
        help="auto: on CUDA flash-attn when it can run, else the Triton kernel, else torch ops; "
        "on CPU torch ops and the compiled CPU kernel; a forced choice that cannot run fails "
        "at start-up",
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        default=d.enforce_eager,
        help="on CUDA, capture no CUDA graphs: every decode step runs eagerly (CPU never uses them)",
    )
    group.add_argument(
        "--kv-cache-memory",
        type=_parse_bytes,
        default=d.kv_cache_memory,
        help="KV cache bytes per worker, e.g. 512M (default: 1G on CPU; on CUDA what "
        "--gpu-memory-utilization leaves after profiling, a set value must fit there)",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=positive_float,
        default=d.gpu_memory_utilization,
        help="CUDA: this engine's share of the device (default 0.9); refused on CPU",
    )
    group.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=d.kv_cache_dtype,
        help="auto: the model's dtype; bfloat16: keys and values rounded to bfloat16 as they are "
        "cached (with a float32 model on CPU: twice the tokens per byte and half the bytes a "
        "decode reads, the outputs no longer exactly transformers')",
    )
    group.add_argument("--policy", choices=POLICIES, default=d.policy)
    group.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    group.add_argument("--max-model-len", type=int, default=d.max_model_len)
    group.add_argument("--dtype", default=d.dtype)
    group.add_argument(
        "--quantization",
        "-q",
        choices=QUANTIZATION_METHODS,
        default=d.quantization,
        help="int8: the decoder's linears and experts in int8, one scale per output row, "
        "activations in --dtype (CPU only; faster decoding at small batches, a quarter of "
        "float32's weight memory; embeddings and the LM head stay in --dtype)",
    )
    group.add_argument("--device", default=d.device)
    group.add_argument("--seed", type=int, default=d.seed)
    group.add_argument("--queue-order", choices=("fcfs", "priority"), default=d.queue_order)
    group.add_argument(
        "--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold
    )
    group.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size)
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=d.data_parallel_size,
        metavar="N",
        help="engine cores side by side, each with its own --tensor-parallel-size workers and "
        "KV pool; every frontend routes each request to one (see --router)",
    )
    group.add_argument(
        "--async-scheduling",
        action="store_true",
        default=d.async_scheduling,
        help="schedule the next step while the workers run the current one (same outputs)",
    )
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        default=d.max_waiting_requests,
        metavar="N",
        help="engine-wide queue cap over every frontend: a request that finds N requests "
        "waiting is refused at once (HTTP 429 + Retry-After); default: no cap",
    )
    group.add_argument(
        "--tbt-slo-ms",
        type=positive_float,
        default=d.tbt_slo_ms,
        metavar="MS",
        help="the inter-token latency promised to clients: while requests decode, each step's "
        "prompt work is sized from a step-cost model learned online so the step stays under MS "
        "(--max-num-batched-tokens stays the hard cap; stall-free only); default: off",
    )
    group.add_argument(
        "--trace-steps",
        metavar="FILE",
        default=d.trace_steps,
        help="write one JSON line per executed step to FILE (see conveyor plot-trace)",
    )
    group.add_argument(
        "--enable-debug-queries",
        action="store_true",
        default=d.enable_debug_queries,
        help="let clients ask whether every request is gone and every KV block free (tests)",
    )
    group.add_argument(
        "--step-timeout-s",
        type=non_negative_float,
        default=d.step_timeout_s,
        help="a step running longer means the engine is hung: it reports itself dead and exits "
        "non-zero (0 = never)",
    )
    group.add_argument(
        "--stats-interval-s",
        type=non_negative_float,
        default=d.stats_interval_s,
        metavar="S",
        help="log the engine's stats line (throughput, running/waiting requests, KV cache, "
        "prefix-cache hits) every S seconds while it works; 0 = never",
    )
    group.add_argument(
        "--generation-config",
        default=d.generation_config,
        metavar="auto|vllm|DIR",
        help="sampling defaults for what a request leaves out (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens): auto = the model's generation_config.json, "
        "vllm = none, DIR = that folder's generation_config.json",
    )
    group.add_argument(
        "--chat-template",
        metavar="FILE",
        default=d.chat_template,
        help="a Jinja chat template replacing the model's own",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=d.tool_call_parser,
        help="the format the model writes tool calls in, for tool_choice auto "
        "(hermes: Hermes, Qwen 2.5/3; llama3_json: Llama 3.x)",
    )
    add_node_args(parser, d)
    return parser


def add_node_args(parser: argparse.ArgumentParser, d: EngineArgs) -> None:
    """Where the hosts of one tensor-parallel group meet."""
    group = parser.add_argument_group("tensor parallelism across hosts")
    group.add_argument("--nnodes", type=int, default=d.nnodes, help="hosts sharing the ranks")
    group.add_argument(
        "--node-rank", type=int, default=d.node_rank, help="this host (0: the head, the engine)"
    )
    group.add_argument(
        "--master-addr",
        default=d.master_addr,
        help="the head's address every host reaches it at (off loopback: CURVE keys needed)",
    )
    group.add_argument(
        "--master-port",
        type=int,
        default=d.master_port,
        help="torch.distributed's port on the head; ZeroMQ takes the next tp+3",
    )
    group.add_argument(
        "--node-timeout-s",
        type=positive_float,
        default=d.node_timeout_s,
        help="a host silent (no heartbeat) this long is gone",
    )
    group.add_argument(
        "--node-join-timeout-s",
        type=positive_float,
        default=d.node_join_timeout_s,
        help="how long the head waits for each host to join, and a host for the head",
    )


def engine_args_from_kwargs(model: str | None, kwargs: dict[str, Any]) -> EngineArgs:
    """``LLM(model, **kwargs)`` -> EngineArgs, naming any keyword it does not know."""
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
    return EngineArgs(model=model, **kwargs)


def _flash_attn_will_run(device: str) -> bool:
    """Whether "auto" will pick flash-attn: a CUDA device and flash_attn installed.

    Looks flash_attn up without importing it (the worker imports it), and imports torch only
    when flash_attn is there, so CPU-only machines pay nothing. The dtype is not known yet: a
    float32 model on CUDA still gets 256-token blocks, which the torch backend runs as well.
    """
    if device not in ("auto", "cuda") and not device.startswith("cuda:"):
        return False
    if importlib.util.find_spec("flash_attn") is None:
        return False
    import torch

    return torch.cuda.is_available()
