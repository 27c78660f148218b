"""load_model_config reads a model directory or says what is wrong; check_engine_config rejects
combinations that cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from conveyor.protocol import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ObservabilityConfig,
    SchedulerConfig,
    check_engine_config,
    load_model_config,
)
from conveyor.protocol.config import NodeConfig, ParallelConfig

HF_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "eos_token_id": 151645,
}


def write_model_dir(path: Path, config: dict, generation_config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


# ---------------------------------------------------------------- load_model_config


def test_reads_what_the_engine_needs(tmp_path: Path):
    model_dir = write_model_dir(tmp_path / "qwen3", HF_CONFIG)
    config = load_model_config(model_dir, dtype="bfloat16", seed=3)
    assert config == ModelConfig(
        model=str(model_dir.resolve()),
        architecture="Qwen3ForCausalLM",
        vocab_size=151936,
        max_model_len=40960,
        eos_token_ids=(151645,),
        dtype="bfloat16",
        seed=3,
    )


def test_generation_config_eos_ids_win(tmp_path: Path):
    model_dir = write_model_dir(
        tmp_path / "m", HF_CONFIG, generation_config={"eos_token_id": [151645, 151643]}
    )
    assert load_model_config(model_dir).eos_token_ids == (151645, 151643)


@pytest.mark.parametrize("method", ["bitsandbytes", "gguf", "hqq", "modelopt"])
def test_a_checkpoint_quantized_in_a_format_we_do_not_load_is_refused_by_name(tmp_path, method):
    config = {**HF_CONFIG, "quantization_config": {"quant_method": method, "bits": 4}}
    with pytest.raises(
        ConfigError, match=f"is a {method}-quantized checkpoint.*--quantization int8"
    ):
        load_model_config(write_model_dir(tmp_path / "m", config))


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors", "fp8"])
def test_checkpoints_in_the_formats_we_read_pass_and_say_which(tmp_path, method):
    config = {**HF_CONFIG, "quantization_config": {"quant_method": method, "bits": 4}}
    model_config = load_model_config(write_model_dir(tmp_path / "m", config))
    assert model_config.checkpoint_quantization == method


def test_mxfp4_checkpoints_load(tmp_path: Path):
    config = {**HF_CONFIG, "quantization_config": {"quant_method": "mxfp4"}}
    assert load_model_config(write_model_dir(tmp_path / "m", config)).vocab_size == 151936


def test_missing_max_position_embeddings_defaults_to_2048(tmp_path: Path):
    config = {k: v for k, v in HF_CONFIG.items() if k != "max_position_embeddings"}
    assert load_model_config(write_model_dir(tmp_path / "m", config)).max_model_len == 2048


def test_max_model_len_may_shrink_the_context(tmp_path: Path):
    model_dir = write_model_dir(tmp_path / "m", HF_CONFIG)
    assert load_model_config(model_dir, max_model_len=4096).max_model_len == 4096


@pytest.mark.parametrize("max_model_len", [0, 40961])
def test_max_model_len_outside_the_model_is_refused(tmp_path: Path, max_model_len: int):
    model_dir = write_model_dir(tmp_path / "m", HF_CONFIG)
    with pytest.raises(ConfigError, match=f"max_model_len {max_model_len} must be between 1"):
        load_model_config(model_dir, max_model_len=max_model_len)


def test_missing_directory(tmp_path: Path):
    with pytest.raises(ConfigError, match="model directory not found"):
        load_model_config(tmp_path / "nowhere")


def test_a_file_is_not_a_model_directory(tmp_path: Path):
    file_path = tmp_path / "model.safetensors"
    file_path.write_bytes(b"")
    with pytest.raises(ConfigError, match="model directory not found"):
        load_model_config(file_path)


def test_directory_without_config_json(tmp_path: Path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="has no config.json"):
        load_model_config(tmp_path)


def test_config_json_without_architecture(tmp_path: Path):
    config = {k: v for k, v in HF_CONFIG.items() if k != "architectures"}
    with pytest.raises(ConfigError, match="names no architecture"):
        load_model_config(write_model_dir(tmp_path / "m", config))


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ---------------------------------------------------------------- check_engine_config

MODEL = ModelConfig(model="/m", architecture="Qwen3ForCausalLM", vocab_size=100, max_model_len=8192)


def engine_config(**scheduler: object) -> EngineConfig:
    return EngineConfig(model=MODEL, scheduler=SchedulerConfig(**scheduler))  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["stall-free", "prefill-first", "orca", "static"])
def test_every_policy_with_a_whole_prompt_budget_is_accepted(policy: str):
    check_engine_config(engine_config(policy=policy, max_num_batched_tokens=4096))


def test_stall_free_may_chunk_with_a_small_budget():
    check_engine_config(engine_config(max_num_batched_tokens=256, max_model_len=4096))


BAD_ENGINE_CONFIGS = [
    (engine_config(policy="fifo"), "policy must be one of stall-free, prefill-first, orca"),
    (
        msgspec.structs.replace(
            engine_config(), observability=ObservabilityConfig(stats_interval_s=-1.0)
        ),
        "stats_interval_s must be >= 0",
    ),
    (engine_config(max_num_seqs=0), "max_num_seqs must be at least 1"),
    (engine_config(max_num_batched_tokens=0), "max_num_batched_tokens must be at least 1"),
    (engine_config(max_model_len=8193), "scheduler max_model_len 8193 exceeds the model's 8192"),
    (
        engine_config(policy="orca", max_num_batched_tokens=2048, max_model_len=4096),
        r"policy 'orca' runs whole prompts: max_num_batched_tokens \(2048\) must be >= "
        r"max_model_len \(4096\)",
    ),
    (
        engine_config(policy="static", max_num_batched_tokens=100, max_model_len=101),
        "policy 'static' runs whole prompts",
    ),
    (
        engine_config(policy="prefill-first", max_num_batched_tokens=100, max_model_len=101),
        "policy 'prefill-first' runs whole prompts",
    ),
    (
        EngineConfig(model=MODEL, cache=CacheConfig(block_size=12)),
        "block_size must be a power of two, got 12",
    ),
    (
        EngineConfig(model=MODEL, cache=CacheConfig(block_size=0)),
        "block_size must be a power of two, got 0",
    ),
]


@pytest.mark.parametrize(("config", "message"), BAD_ENGINE_CONFIGS)
def test_bad_engine_config_is_refused_with_the_values(config: EngineConfig, message: str):
    with pytest.raises(ConfigError, match=message):
        check_engine_config(config)


def test_config_tree_is_frozen_and_replaced_not_mutated():
    config = EngineConfig(model=MODEL)
    with pytest.raises(AttributeError):
        config.cache.num_blocks = 10  # type: ignore[misc]
    learned = msgspec.structs.replace(
        config, cache=msgspec.structs.replace(config.cache, num_blocks=10)
    )
    assert learned.cache.num_blocks == 10 and config.cache.num_blocks is None


def test_config_tree_crosses_processes_as_msgpack():
    config = EngineConfig(
        model=MODEL, cache=CacheConfig(num_blocks=512), scheduler=SchedulerConfig(policy="orca")
    )
    frame = msgspec.msgpack.encode(config)
    assert msgspec.msgpack.decode(frame, type=EngineConfig) == config


def test_unknown_policy_on_the_wire_is_rejected():
    frame = msgspec.msgpack.encode({"policy": "fifo"})
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value 'fifo'"):
        msgspec.msgpack.decode(frame, type=SchedulerConfig)


def _nodes(tp: int = 2, **nodes: object) -> EngineConfig:
    layout = NodeConfig(**nodes)  # type: ignore[arg-type]
    return EngineConfig(model=MODEL, parallel=ParallelConfig(tensor_parallel_size=tp, nodes=layout))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_nodes(nnodes=2, node_rank=2), r"node_rank must be in \[0, nnodes=2\), got 2"),
        (_nodes(tp=3, nnodes=2), "tensor_parallel_size 3 must be a multiple of nnodes 2"),
        (_nodes(nnodes=2, master_port=65534), "master_port 65534 leaves no room"),
        (_nodes(nnodes=2, timeout_s=0.0), "timeout_s and join_timeout_s must be > 0"),
    ],
)
def test_a_node_layout_that_cannot_run_is_refused(config: EngineConfig, message: str):
    with pytest.raises(ConfigError, match=message):
        check_engine_config(config)
    check_engine_config(_nodes(tp=4, nnodes=2, node_rank=1))
