"""The one frozen configuration tree, shared by every process.

Each component receives only the part it uses. Values learned later (the number of KV blocks the
workers can hold) arrive through ``msgspec.structs.replace``, never by mutation. The structs are
msgspec Structs so the tree can be sent to another process as it is.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Literal

import msgspec

from conveyor.protocol.lora import LoRAConfig, lora_config_problem
from conveyor.protocol.sampling_params import MAX_LOGPROBS
from conveyor.protocol.speculative import SpeculativeConfig

Policy = Literal["stall-free", "prefill-first", "orca", "static"]
QueueOrder = Literal["fcfs", "priority"]

POLICIES: tuple[str, ...] = ("stall-free", "prefill-first", "orca", "static")
# "auto": flash-attn where it can run, else the torch backend (with the compiled CPU kernel on
# CPU); "torch": torch ops only; "cpu-kernel": the torch backend with the compiled kernel required.
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "flash-attn", "triton", "torch", "cpu-kernel")
# Weights turned into another format at load time (None: as the checkpoint has them). "int8":
# weight-only, one scale per output row, CPU only (worker/layers/int8_linear.py); "int4": 4-bit,
# one scale per 64 input features, CPU only (worker/layers/quantization/int4_at_load.py).
LOAD_TIME_QUANTIZATIONS: tuple[str, ...] = ("int8", "int4")
# Quantized checkpoint formats, by vLLM's names: config.json's quantization_config says which a
# checkpoint is, and ``--quantization`` naming one checks it (worker/layers/quantization/).
CHECKPOINT_QUANTIZATIONS: tuple[str, ...] = ("fp8", "compressed-tensors", "gptq", "awq")
QUANTIZATION_METHODS: tuple[str, ...] = LOAD_TIME_QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS
# What the KV cache holds (``--kv-cache-dtype``): "auto" is the model's dtype; "bfloat16" rounds
# each key and value to bfloat16 as it is written (half a float32 cache's bytes: twice the
# tokens, half the reads per decode step; the arithmetic stays in the model's dtype).
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "bfloat16")
# The quantized checkpoint formats (config.json's quantization_config.quant_method) the loader
# reads; any other is refused by name rather than failing on tensors it does not know.
LOADABLE_QUANTIZED_CHECKPOINTS: tuple[str, ...] = ("mxfp4", *CHECKPOINT_QUANTIZATIONS)


class ConfigError(ValueError):
    """A configuration value or model directory that cannot work; the message says which."""


class ModelConfig(msgspec.Struct, frozen=True):
    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    # "auto" = float32 on CPU, bfloat16 on CUDA; otherwise a torch dtype name.
    dtype: str = "auto"
    seed: int = 0
    # Sampling defaults for the fields a request leaves out, as SamplingParams names them, from
    # the model's generation_config.json (see ``read_sampling_defaults``); empty: ours.
    sampling_defaults: dict[str, int | float] = {}
    # A chat template that replaces the tokenizer's own (``--chat-template FILE``).
    chat_template: str | None = None
    # How the frontends read tool calls out of the text for ``tool_choice: "auto"``
    # (``--tool-call-parser`` with ``--enable-auto-tool-choice``); None: no auto.
    tool_call_parser: str | None = None
    # How the frontends split a chat answer's reasoning out of its content
    # (``--reasoning-parser``); None: the reasoning stays in the content.
    reasoning_parser: str | None = None
    # Object schemas of structured outputs admit no keys beyond their properties unless they
    # say so (``--default-additional-properties false``, the default).
    strict_object_schemas: bool = True
    # One of QUANTIZATION_METHODS, applied to the decoder's linears and experts at load time;
    # None: none.
    quantization: str | None = None
    # config.json's quantization_config.quant_method (None: a float checkpoint).
    checkpoint_quantization: str | None = None
    # The tokenizer's directory when it is not the model's (``--tokenizer``); None: ``model``.
    tokenizer: str | None = None
    # The most logprobs (and prompt logprobs) a request may ask for per token (--max-logprobs;
    # at most the vocabulary).
    max_logprobs: int = MAX_LOGPROBS

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.model


class CacheConfig(msgspec.Struct, frozen=True):
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Bytes of KV cache per worker. None: 1 GiB on CPU; on CUDA what gpu_memory_utilization
    # leaves after the profiling pass (a set value there is the cache's size, checked to fit).
    kv_cache_memory: int | None = None
    # CUDA: this engine's share of the device; None: 0.9. Refused on CPU, which has no share.
    gpu_memory_utilization: float | None = None
    # One of KV_CACHE_DTYPES.
    cache_dtype: str = "auto"
    # Learned from the workers at start-up; None until then.
    num_blocks: int | None = None
    # Also learned from the workers: the model's widest sliding window when every layer has one
    # (a request's blocks wholly behind it are freed while it runs); None: keep every block.
    sliding_window: int | None = None


class SchedulerConfig(msgspec.Struct, frozen=True):
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 4096
    # A prefill chunk of one request is capped at this many tokens per step (0 = no cap), so one
    # long prompt cannot take the whole budget from other prompts waiting behind it.
    long_prefill_token_threshold: int = 0
    policy: Policy = "stall-free"
    queue_order: QueueOrder = "fcfs"
    # Schedule step N+1 while the workers run step N (same tokens, the engine's own work hidden
    # behind the forward pass).
    async_scheduling: bool = False
    # The engine-wide queue cap: a new request that finds this many waiting (from every client
    # together) is rejected at once instead of queued (None = no cap). Preemption may still put
    # requests back in the queue past it; they were admitted before.
    max_waiting_requests: int | None = None
    # The inter-token latency promised to clients (ms; None = off). While any request decodes,
    # each step is sized from a step-cost model learned online so that its predicted time stays
    # under this; max_num_batched_tokens stays the hard cap (engine_core/step_budget.py).
    tbt_slo_ms: float | None = None
    # Under tbt_slo_ms a prompt chunk is never smaller than this (unless the prompt's rest is),
    # so prompts progress even when the decodes alone fill the SLO.
    slo_min_chunk_tokens: int = 32
    # Speculative decoding (``--speculative-config``; None = off): the scheduler gives a request
    # its drafts as tokens, the workers propose and verify them (engine_core/spec_decode.py).
    speculative: SpeculativeConfig | None = None


class NodeConfig(msgspec.Struct, frozen=True):
    """Tensor parallelism across hosts: where the ranks meet and how long a silent host lives.

    Node 0 (the head) runs the engine core and ranks [0, tp/nnodes); node k runs the next
    tp/nnodes ranks as ``conveyor serve --headless``. The head listens on master_port (the
    torch.distributed store) and the ports after it (the workers' channels).
    """

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # A host not heard from (heartbeats) for this long is gone: the head fails, a headless host
    # stops its workers.
    timeout_s: float = 10.0
    # How long each side waits to hear from the other the first time.
    join_timeout_s: float = 300.0


class ParallelConfig(msgspec.Struct, frozen=True):
    tensor_parallel_size: int = 1
    # Engine cores serving the same model side by side, each with its own workers and KV pool;
    # every frontend is a client of all of them and routes each request to one.
    data_parallel_size: int = 1
    # This engine's index among data-parallel engines (the ``engine`` label of its metrics).
    data_parallel_rank: int = 0
    # Hosts sharing this engine's tensor-parallel ranks (one: all on this host).
    nodes: NodeConfig = NodeConfig()


class ObservabilityConfig(msgspec.Struct, frozen=True):
    # A JSON-lines file the engine core writes one record per executed step to (None = off).
    trace_steps: str | None = None
    # Answer CheckAllFree (block accounting) queries; for tests and debugging, off in production.
    debug_queries: bool = False
    # A step that runs longer than this (seconds) means the engine is hung: it tells every client
    # it is dead and exits non-zero, so the supervisor stops everything (0 = never).
    step_timeout_s: float = 600.0
    # The engine core logs a stats line (throughput, queue, KV cache, prefix hits) this often
    # while it has work (seconds; 0 = never).
    stats_interval_s: float = 10.0


class EngineConfig(msgspec.Struct, frozen=True):
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    # "auto" = CUDA when available, else CPU.
    device: str = "auto"
    # One of ATTENTION_BACKENDS; a forced choice that cannot run fails at start-up.
    attention_backend: str = "auto"
    # No CUDA graphs: every step runs eagerly (on CPU they are never used).
    enforce_eager: bool = False
    # LoRA adapters (--enable-lora); None: the base model only.
    lora: LoRAConfig | None = None


def _as_id_tuple(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)  # type: ignore[union-attr]


def load_model_config(
    model: str | os.PathLike[str],
    dtype: str = "auto",
    max_model_len: int | None = None,
    seed: int = 0,
) -> ModelConfig:
    """Read what the engine needs from a local Hugging Face model directory (no torch)."""
    path = Path(model)
    if not path.is_dir():
        raise ConfigError(f"model directory not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{path} has no config.json; is it a Hugging Face model directory?")
    hf = json.loads(config_file.read_text())
    architectures = hf.get("architectures") or []
    if not architectures:
        raise ConfigError(f"{config_file} names no architecture")
    checkpoint_format = (hf.get("quantization_config") or {}).get("quant_method")
    if checkpoint_format not in (None, *LOADABLE_QUANTIZED_CHECKPOINTS):
        raise ConfigError(
            f"{path} is a {checkpoint_format}-quantized checkpoint, which conveyor does not load "
            f"(it loads {', '.join(LOADABLE_QUANTIZED_CHECKPOINTS)}); point it at the unquantized "
            f"model and add --quantization int8 for int8 weights on CPU"
        )
    eos = _as_id_tuple(hf.get("eos_token_id"))
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos = _as_id_tuple(json.loads(gen_file.read_text()).get("eos_token_id")) or eos
    derived_len, why = _context_length(hf)
    if max_model_len is None:
        max_model_len = derived_len
    elif not 1 <= max_model_len <= derived_len:
        raise ConfigError(
            f"max_model_len {max_model_len} must be between 1 and the model's {derived_len}{why}"
        )
    return ModelConfig(
        model=str(path.resolve()),
        architecture=architectures[0],
        vocab_size=int(hf["vocab_size"]),
        max_model_len=max_model_len,
        eos_token_ids=eos,
        dtype=dtype,
        seed=seed,
        checkpoint_quantization=checkpoint_format,
    )


def _context_length(hf: dict) -> tuple[int, str]:
    """The longest sequence we serve for a config.json, and why when it is not the model's own.

    LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini) changes every position's rotation once a sequence
    outgrows the original context; transformers then re-encodes the whole sequence, which a KV
    cache cannot, so we serve the original context only (worker/layers/rotary.py). Phi-3's config
    class reads the old names "su" and "yarn" as longrope.
    """
    length = int(hf.get("max_position_embeddings") or 2048)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type")
    is_longrope = kind == "longrope" or (hf.get("model_type") == "phi3" and kind in ("su", "yarn"))
    original = hf.get("original_max_position_embeddings") or rope.get(
        "original_max_position_embeddings"
    )
    if is_longrope and original and int(original) < length:
        why = " (longrope RoPE is served within its original_max_position_embeddings only)"
        return int(original), why
    return length, ""


# generation_config.json keys a server takes as sampling defaults, and their SamplingParams names.
GENERATION_CONFIG_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def read_sampling_defaults(
    source: str, model_dir: str | os.PathLike[str]
) -> dict[str, int | float]:
    """The sampling defaults ``--generation-config`` names, as SamplingParams fields.

    ``auto``: the model directory's generation_config.json; ``vllm``: none (the server's own
    defaults: temperature 1, no filters); anything else: a directory holding a
    generation_config.json. Only the keys the file sets are taken, as vLLM does, so a file that
    sets only ``eos_token_id`` changes no sampling default.
    """
    if source == "vllm":
        return {}
    folder = Path(model_dir) if source == "auto" else Path(source)
    path = folder / "generation_config.json"
    if not path.is_file():
        if source == "auto":
            return {}
        raise ConfigError(f"--generation-config {source}: no generation_config.json there")
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not readable JSON: {exc}") from None
    defaults: dict[str, int | float] = {}
    for key, name in GENERATION_CONFIG_SAMPLING_KEYS.items():
        value = values.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            defaults[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    return defaults


def _non_finite_field(parts: dict[str, msgspec.Struct]) -> str | None:
    """The first float field of these config parts (``NodeConfig`` inside ``ParallelConfig``
    included) that is NaN or infinite, by its dotted name: every comparison with NaN is false,
    so the range checks below would let one through to the first step that needs a number."""
    for part_name, part in parts.items():
        for name, value in msgspec.structs.asdict(part).items():
            if isinstance(value, msgspec.Struct):
                found = _non_finite_field({f"{part_name}.{name}": value})
                if found is not None:
                    return found
            elif isinstance(value, float) and not math.isfinite(value):
                return f"{part_name}.{name} must be a finite number, got {value}"
    return None


def check_engine_config(config: EngineConfig) -> None:
    """Reject combinations that cannot run, with a message naming the values."""
    sched, cache = config.scheduler, config.cache
    problem = _non_finite_field(
        {
            "scheduler": sched,
            "cache": cache,
            "parallel": config.parallel,
            "observability": config.observability,
        }
    )
    if problem is not None:
        raise ConfigError(problem)
    if sched.policy not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {sched.policy!r}")
    if config.observability.stats_interval_s < 0:
        raise ConfigError(
            f"stats_interval_s must be >= 0 (0 = no stats line), got "
            f"{config.observability.stats_interval_s}"
        )
    if config.observability.step_timeout_s < 0:
        raise ConfigError(
            f"step_timeout_s must be >= 0 (0 = never), got {config.observability.step_timeout_s}"
        )
    utilization = cache.gpu_memory_utilization
    if utilization is not None and not 0 < utilization <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if sched.max_num_seqs < 1:
        raise ConfigError("max_num_seqs must be at least 1")
    parallel = config.parallel
    if parallel.data_parallel_size < 1:
        raise ConfigError(
            f"data_parallel_size must be at least 1, got {parallel.data_parallel_size}"
        )
    if not 0 <= parallel.data_parallel_rank < parallel.data_parallel_size:
        raise ConfigError(
            f"data_parallel_rank must be in [0, data_parallel_size={parallel.data_parallel_size})"
            f", got {parallel.data_parallel_rank}"
        )
    if sched.max_num_batched_tokens < 1:
        raise ConfigError("max_num_batched_tokens must be at least 1")
    if config.lora is not None:
        problem = lora_config_problem(config.lora)
        if problem is not None:
            raise ConfigError(problem)
    if sched.tbt_slo_ms is not None:
        if sched.tbt_slo_ms <= 0:
            raise ConfigError(f"tbt_slo_ms must be > 0, got {sched.tbt_slo_ms}")
        if sched.policy != "stall-free":
            # Only a chunking policy can size a step: the others run whole prompts.
            raise ConfigError(f"tbt_slo_ms needs policy 'stall-free', got {sched.policy!r}")
    if sched.slo_min_chunk_tokens < 1:
        raise ConfigError(f"slo_min_chunk_tokens must be >= 1, got {sched.slo_min_chunk_tokens}")
    if sched.max_waiting_requests is not None and sched.max_waiting_requests < 0:
        raise ConfigError(f"max_waiting_requests must be >= 0, got {sched.max_waiting_requests}")
    if sched.max_model_len > config.model.max_model_len:
        raise ConfigError(
            f"scheduler max_model_len {sched.max_model_len} exceeds the model's "
            f"{config.model.max_model_len}"
        )
    if sched.policy in ("orca", "static", "prefill-first") and (
        sched.max_num_batched_tokens < sched.max_model_len
    ):
        # These policies never chunk a prompt, so the budget must hold the longest one.
        raise ConfigError(
            f"policy {sched.policy!r} runs whole prompts: max_num_batched_tokens "
            f"({sched.max_num_batched_tokens}) must be >= max_model_len ({sched.max_model_len})"
        )
    if config.attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
            f"got {config.attention_backend!r}"
        )
    if cache.block_size < 1 or cache.block_size & (cache.block_size - 1):
        raise ConfigError(f"block_size must be a power of two, got {cache.block_size}")
    if cache.cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {cache.cache_dtype!r}"
        )
    if (
        cache.cache_dtype != "auto"
        and config.device not in ("cpu", "auto")
        and config.model.dtype not in ("auto", cache.cache_dtype)
    ):
        # The GPU attention backends read a cache of the model's own dtype only.
        raise ConfigError(
            f"kv_cache_dtype {cache.cache_dtype!r} with a {config.model.dtype} model runs on CPU "
            f"only, not {config.device!r}"
        )
    quantization = config.model.quantization
    checkpoint = config.model.checkpoint_quantization
    if quantization in CHECKPOINT_QUANTIZATIONS and quantization != checkpoint:
        raise ConfigError(
            f"quantization {quantization!r}, but the checkpoint is "
            f"{f'{checkpoint}-quantized' if checkpoint else 'not quantized'}"
        )
    if quantization in LOAD_TIME_QUANTIZATIONS and checkpoint in CHECKPOINT_QUANTIZATIONS:
        raise ConfigError(
            f"quantization {quantization!r} quantizes a float checkpoint at load; this one is "
            f"already {checkpoint}-quantized (drop --quantization)"
        )
    if config.lora is not None and (quantization or checkpoint):
        # The slots' corrections would run beside quantized base weights that no test holds
        # against PEFT (which applies adapters to float weights): refused until one does.
        raise ConfigError(
            f"LoRA adapters (enable_lora) are not served over {quantization or checkpoint}-"
            "quantized weights yet; serve the float checkpoint without --quantization"
        )
    if quantization is not None:
        if quantization not in QUANTIZATION_METHODS:
            raise ConfigError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or none), "
                f"got {quantization!r}"
            )
        if quantization in LOAD_TIME_QUANTIZATIONS and config.device not in ("cpu", "auto"):
            raise ConfigError(
                f"quantization {quantization!r} runs on CPU only, not {config.device!r}; "
                "use --device cpu"
            )
    check_node_config(config.parallel)


def check_node_config(parallel: ParallelConfig) -> None:
    """Tensor-parallel ranks split evenly over the hosts, a node rank that exists, sane times."""
    nodes, tp = parallel.nodes, parallel.tensor_parallel_size
    if nodes.nnodes < 1 or not 0 <= nodes.node_rank < nodes.nnodes:
        raise ConfigError(f"node_rank must be in [0, nnodes={nodes.nnodes}), got {nodes.node_rank}")
    if tp % nodes.nnodes:
        raise ConfigError(
            f"tensor_parallel_size {tp} must be a multiple of nnodes {nodes.nnodes} "
            "(every host runs the same number of ranks)"
        )
    if nodes.nnodes > 1 and parallel.data_parallel_size > 1:
        raise ConfigError("tensor parallelism across hosts serves one engine: data_parallel_size 1")
    if not 0 < nodes.master_port < 65536 - 4 - tp:
        raise ConfigError(f"master_port {nodes.master_port} leaves no room for the ports after it")
    if nodes.timeout_s <= 0 or nodes.join_timeout_s <= 0:
        raise ConfigError("node timeout_s and join_timeout_s must be > 0")
