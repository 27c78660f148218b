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
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from conveyor.frontend.model_source import resolve_model
from conveyor.frontend.parsers.reasoning import REASONING_PARSERS
from conveyor.frontend.parsers.tool_calls import TOOL_CALL_PARSERS
from conveyor.frontend.speculative_draft import resolve_draft
from conveyor.frontend.vllm_flags import ENGINE_FLAGS, add_vllm_flags
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
    CHECKPOINT_QUANTIZATIONS,
    GENERATION_CONFIG_SAMPLING_KEYS,
    KV_CACHE_DTYPES,
    LOAD_TIME_QUANTIZATIONS,
    POLICIES,
    QUANTIZATION_METHODS,
    ConfigError,
    ModelConfig,
    NodeConfig,
    read_sampling_defaults,
)
from conveyor.protocol.lora import LORA_DTYPES, LoRAConfig
from conveyor.protocol.sampling_params import MAX_LOGPROBS, SamplingParams
from conveyor.protocol.speculative import SpeculativeConfig, parse_speculative_config
from conveyor.runtime import cpu_isa
from conveyor.runtime.flags import (
    finite_float,
    human_readable_int,
    human_readable_int_or_auto,
    non_negative_float,
    positive_float,
    positive_human_readable_int,
)

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
    # The tokenizer's directory or id (None: the model's), and its revision.
    tokenizer: str | None = None
    tokenizer_revision: str | None = None
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
    # vLLM's --speculative-config: a JSON object (or a dict, offline) such as {"method": "ngram",
    # "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}; None: off.
    speculative_config: str | dict[str, Any] | None = None
    trace_steps: str | None = None
    enable_debug_queries: bool = False
    step_timeout_s: float = 600.0
    # The engine's stats line every this many seconds while it works (0 = never).
    stats_interval_s: float = 10.0
    # Sampling defaults: "auto" (the model's generation_config.json), "vllm" (none) or a folder.
    generation_config: str = "auto"
    # A Jinja chat template file replacing the tokenizer's own.
    chat_template: str | None = None
    # The format of the model's tool calls (a name of TOOL_CALL_PARSERS).
    tool_call_parser: str | None = None
    # The format of the model's reasoning (a name of REASONING_PARSERS): split out of content.
    reasoning_parser: str | None = None
    # What an object schema that says nothing of other keys admits beyond its properties:
    # False (nothing: strict, as xgrammar's and OpenAI's) or True (any key, JSON Schema's).
    default_additional_properties: bool = False
    # tool_choice "auto" (vLLM's contract: it needs this and tool_call_parser; without it a
    # request asking for auto is refused, and required or named choices still work).
    enable_auto_tool_choice: bool = False
    # Sampling defaults set or replaced on top of generation_config's, by generation_config.json
    # names ({"temperature": 0.6, "max_new_tokens": 512}).
    override_generation_config: dict[str, Any] | None = None
    # The most logprobs a request may ask for per token (vLLM's default); -1: the vocabulary.
    max_logprobs: int = MAX_LOGPROBS
    # Accepted for vLLM's sake: conveyor runs its own implementation of every architecture and
    # loads tokenizers without custom code, so no repository code ever runs either way.
    trust_remote_code: bool = False
    # LoRA adapters (vLLM's flags): served only with enable_lora; see protocol.lora.LoRAConfig.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"

    def _speculative_config(self, target: ModelConfig) -> SpeculativeConfig | None:
        try:
            spec = parse_speculative_config(self.speculative_config)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        draft_dir = None
        if spec is not None and spec.model is not None:
            draft_dir = resolve_model(spec.model, None, self.download_dir)
        return resolve_draft(spec, target, draft_dir, self._device())

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model directory and build the checked, frozen config tree."""
        model = str(DEFAULT_MODEL_DIR) if self.model is None else self.model
        model = resolve_model(model, self.revision, self.download_dir)
        model_config = load_model_config(model, self.dtype, self.max_model_len, self.seed)
        model_config = msgspec.structs.replace(
            model_config,
            sampling_defaults=self._sampling_defaults(model_config.model),
            chat_template=self._read_chat_template(),
            tool_call_parser=self._auto_tool_call_parser(),
            reasoning_parser=self._reasoning_parser(),
            strict_object_schemas=not self.default_additional_properties,
            quantization=self.quantization,
            tokenizer=self._tokenizer_dir(model),
            max_logprobs=self._max_logprobs(model_config.vocab_size),
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
                speculative=self._speculative_config(model_config),
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
            lora=self._lora_config(),
        )
        check_engine_config(config)
        try:  # read by the workers' kernel builds: a typo fails here, before any process starts
            cpu_isa.requested()
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return config

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.lora_dtype)

    def _max_logprobs(self, vocab_size: int) -> int:
        if self.max_logprobs == -1:
            return vocab_size
        if not 0 <= self.max_logprobs <= vocab_size:
            raise ConfigError(
                f"max_logprobs must be in [0, {vocab_size}] (the vocabulary) or -1 (all of it), "
                f"got {self.max_logprobs}"
            )
        return self.max_logprobs

    def _tokenizer_dir(self, model_dir: str) -> str | None:
        """The --tokenizer directory, or None for the model's own."""
        if self.tokenizer is None:
            if self.tokenizer_revision is not None:
                raise ConfigError("--tokenizer-revision needs --tokenizer")
            return None
        tokenizer = resolve_model(
            self.tokenizer, self.tokenizer_revision, self.download_dir, weights=False
        )
        return None if tokenizer == model_dir else tokenizer

    def _auto_tool_call_parser(self) -> str | None:
        """The parser of tool_choice "auto", or None: auto needs --enable-auto-tool-choice and
        --tool-call-parser, as in vLLM (required and named choices need neither)."""
        parser = self.tool_call_parser
        if parser is not None and parser not in TOOL_CALL_PARSERS:
            names = ", ".join(sorted(TOOL_CALL_PARSERS))
            raise ConfigError(f"tool_call_parser must be one of {names}, got {parser!r}")
        if self.enable_auto_tool_choice and parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser")
        if parser is not None and not self.enable_auto_tool_choice:
            logger.warning(
                'tool_choice "auto" stays off: --tool-call-parser %s without '
                "--enable-auto-tool-choice",
                parser,
            )
        return parser if self.enable_auto_tool_choice else None

    def _reasoning_parser(self) -> str | None:
        parser = self.reasoning_parser
        if parser is not None and parser not in REASONING_PARSERS:
            names = ", ".join(sorted(REASONING_PARSERS))
            raise ConfigError(f"reasoning_parser must be one of {names}, got {parser!r}")
        return parser

    def _sampling_defaults(self, model_dir: str) -> dict[str, int | float]:
        """generation_config's sampling defaults with override_generation_config on top."""
        defaults = read_sampling_defaults(self.generation_config, model_dir)
        for key, value in (self.override_generation_config or {}).items():
            name = GENERATION_CONFIG_SAMPLING_KEYS.get(key)
            if name is None:
                raise ConfigError(
                    f"override_generation_config: {key!r} is not a sampling default conveyor "
                    f"takes (one of {', '.join(GENERATION_CONFIG_SAMPLING_KEYS)})"
                )
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigError(f"override_generation_config: {key} must be a number")
            defaults[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
        try:  # every request starts from these: a bad one must fail here, not each request
            SamplingParams(**defaults)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"override_generation_config: {exc}") from None
        return defaults

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
        if self.device == "auto" and self.quantization in LOAD_TIME_QUANTIZATIONS:
            return "cpu"
        return self.device

    def _read_chat_template(self) -> str | None:
        """The file chat_template names or, as vLLM takes it too, the template itself."""
        if self.chat_template is None:
            return None
        if not Path(self.chat_template).exists() and any(
            mark in self.chat_template for mark in ("{{", "{%")
        ):
            return self.chat_template
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
        type=human_readable_int,
        default=d.max_num_batched_tokens,
        help="token budget per step, e.g. 8192 or 8k (default 2048; whole-prompt policies: "
        "max(2048, context))",
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
        type=_attention_backend,
        metavar="{" + ",".join(ATTENTION_BACKENDS) + "}",
        default=d.attention_backend,
        help="auto: on CUDA flash-attn when it can run, else the Triton kernel, else torch ops; "
        "on CPU torch ops and the compiled CPU kernel; a forced choice that cannot run fails "
        "at start-up",
    )
    group.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
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
        "--kv-cache-memory-bytes",
        dest="kv_cache_memory",
        type=positive_human_readable_int,
        default=argparse.SUPPRESS,
        help="the same as vLLM writes it: 8G = 8 GiB, 8g = 8,000,000,000 bytes",
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
    group.add_argument(
        "--max-model-len",
        type=human_readable_int_or_auto,
        default=d.max_model_len,
        help="context length, e.g. 4096, 32k (32,000) or 32K (32,768); auto or -1 (the default): "
        "the model's, lowered to what the KV cache holds",
    )
    group.add_argument("--dtype", default=d.dtype)
    group.add_argument(
        "--quantization",
        "-q",
        type=_quantization,
        metavar="{" + ",".join(QUANTIZATION_METHODS) + "}",
        default=d.quantization,
        help="int8: the decoder's linears and experts in int8, one scale per output row, "
        "activations in --dtype (CPU only; faster decoding at small batches, a quarter of "
        "float32's weight memory; embeddings and the LM head stay in --dtype). int4: the same "
        "with 4-bit weights, one scale per 64 inputs (dense models; half of int8's bytes). fp8, "
        "compressed-tensors, gptq, awq: the checkpoint's own format, read from config.json's "
        "quantization_config without this flag; naming one checks the checkpoint is that",
    )
    group.add_argument("--device", default=d.device)
    group.add_argument("--seed", type=int, default=d.seed)
    group.add_argument(
        "--queue-order",
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default=d.queue_order,
        help="fcfs, or priority (a request's priority field, lower first)",
    )
    group.add_argument(
        "--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold
    )
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size)
    group.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=d.data_parallel_size,
        metavar="N",
        help="engine cores side by side, each with its own --tensor-parallel-size workers and "
        "KV pool; every frontend routes each request to one (see --router)",
    )
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
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
        "--speculative-config",
        "-sc",
        default=d.speculative_config,
        metavar="JSON",
        help='speculative decoding, vLLM\'s syntax: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
        '(n-gram prompt lookup) or \'{"model": DIR, "num_speculative_tokens": 4}\' (a draft '
        'model of the same vocabulary, method "draft_model"; "quantization": "int8"/"int4" '
        "quantizes it at load on CPU); greedy outputs unchanged, sampling keeps its "
        'distribution; "disable_by_batch_size": N turns drafts off while more than N requests '
        "run (default 8); default: off",
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
        "--disable-log-stats",
        dest="stats_interval_s",
        action="store_const",
        const=0.0,
        default=argparse.SUPPRESS,
        help="no stats line (--stats-interval-s 0)",
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
        "--override-generation-config",
        type=_json_object,
        default=d.override_generation_config,
        metavar="JSON",
        help="sampling defaults set on top of --generation-config's, by generation_config.json "
        'names, e.g. \'{"temperature": 0.6, "max_new_tokens": 512}\'',
    )
    group.add_argument(
        "--chat-template",
        metavar="FILE",
        default=d.chat_template,
        help="a Jinja chat template replacing the model's own (a file, or the template itself)",
    )
    group.add_argument(
        "--tokenizer",
        default=d.tokenizer,
        help="the tokenizer's directory or cached Hugging Face id (default: the model's)",
    )
    group.add_argument(
        "--tokenizer-revision",
        default=d.tokenizer_revision,
        help="with a --tokenizer id: the snapshot's branch, tag or commit",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        default=d.tool_call_parser,
        help="the format the model writes tool calls in (vLLM's names: hermes for Hermes and "
        "Qwen 2.5/3, llama3_json, mistral, ...; docs/api.md lists them); tool_choice auto needs "
        "--enable-auto-tool-choice too",
    )
    group.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=d.reasoning_parser,
        help="the format of the model's reasoning (vLLM's names: qwen3, deepseek_r1, "
        "deepseek_v3, openai_gptoss, mistral, granite): split out of the content into the "
        "response's reasoning field",
    )
    group.add_argument(
        "--default-additional-properties",
        type=_false_or_true,
        metavar="{false,true}",
        default=d.default_additional_properties,
        help="what a JSON schema's object admits beyond its properties when it does not say "
        "(additionalProperties): false (default: nothing, as xgrammar's strict mode and "
        "OpenAI's structured outputs) or true (any key, JSON Schema's default)",
    )
    group.add_argument(
        "--max-logprobs",
        type=int,
        default=d.max_logprobs,
        metavar="N",
        help="the most logprobs (and prompt logprobs) a request may ask for per token; -1: the "
        f"whole vocabulary (default {MAX_LOGPROBS})",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        default=d.enable_auto_tool_choice,
        help='serve tool_choice "auto" (the model decides whether to call), read with '
        "--tool-call-parser; without it auto is refused, required and named choices still work",
    )
    add_node_args(parser, d)
    add_lora_args(parser, d)
    add_vllm_flags(parser, ENGINE_FLAGS)
    return parser


# vLLM's names of the attention backends conveyor has too.
_VLLM_ATTENTION_BACKENDS = {
    "FLASH_ATTN": "flash-attn",
    "TRITON_ATTN": "triton",
    "TORCH_SDPA": "torch",
    "CPU_ATTN": "cpu-kernel",
}


def _attention_backend(text: str) -> str:
    name = _VLLM_ATTENTION_BACKENDS.get(text.upper(), text)
    if name not in ATTENTION_BACKENDS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: conveyor's backends are {', '.join(ATTENTION_BACKENDS)} (vLLM's "
            f"{', '.join(_VLLM_ATTENTION_BACKENDS)} are taken for them)"
        )
    return name


def _quantization(text: str) -> str:
    if text not in QUANTIZATION_METHODS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: conveyor quantizes a float checkpoint at load (-q int8 or int4, CPU) and "
            f"reads checkpoints quantized as {', '.join(CHECKPOINT_QUANTIZATIONS)} (and gpt-oss's "
            "mxfp4)"
        )
    return text


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_node_args(parser: argparse.ArgumentParser, d: EngineArgs) -> None:
    """Where the hosts of one tensor-parallel group meet."""
    group = parser.add_argument_group("tensor parallelism across hosts")
    group.add_argument("--nnodes", "-n", type=int, default=d.nnodes, help="hosts sharing the ranks")
    group.add_argument(
        "--node-rank",
        "-r",
        type=int,
        default=d.node_rank,
        help="this host (0: the head, the engine)",
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


def add_lora_args(parser: argparse.ArgumentParser, d: EngineArgs) -> None:
    group = parser.add_argument_group("LoRA adapters (vLLM's flags)")
    group.add_argument(
        "--enable-lora",
        action="store_true",
        default=d.enable_lora,
        help="serve LoRA adapters (PEFT folders or Hugging Face ids) beside the base model, "
        "mixed in every batch",
    )
    group.add_argument(
        "--max-loras",
        type=int,
        default=d.max_loras,
        metavar="N",
        help=f"adapters one step may mix: the workers' slots (default {d.max_loras})",
    )
    group.add_argument(
        "--max-lora-rank",
        type=int,
        default=d.max_lora_rank,
        metavar="R",
        help=f"the largest adapter rank served; every slot is this wide (default {d.max_lora_rank})",
    )
    group.add_argument(
        "--max-cpu-loras",
        type=int,
        default=d.max_cpu_loras,
        metavar="N",
        help="adapters kept loaded in host memory beside the slots, an LRU (default --max-loras)",
    )
    group.add_argument(
        "--lora-dtype",
        default=d.lora_dtype,
        choices=LORA_DTYPES,
        help="the adapters' dtype in the slots (default auto: the model's)",
    )


def _false_or_true(text: str) -> bool:
    if text not in ("false", "true"):
        raise argparse.ArgumentTypeError(f"expected false or true, got {text!r}")
    return text == "true"


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
