"""EngineArgs: command-line flags and keyword arguments -> the checked, frozen EngineConfig."""

from __future__ import annotations

import argparse
import math

import pytest

from conveyor.frontend.engine_args import EngineArgs, add_engine_args, engine_args_from_kwargs
from conveyor.protocol import ConfigError
from tests.devices import x86_only


def test_cli_flags_become_the_config_tree(tiny_model_dir):
    parser = add_engine_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--model", str(tiny_model_dir), "--max-num-seqs", "8", "--kv-cache-memory", "64M"]
        + ["--no-enable-prefix-caching", "--max-model-len", "512", "--policy", "orca"]
        + ["--max-num-batched-tokens", "512", "--block-size", "32"]
    )
    config = EngineArgs.from_cli(args).create_engine_config()
    assert config.scheduler.max_num_seqs == 8 and config.scheduler.policy == "orca"
    assert config.cache.kv_cache_memory == 64 << 20 and not config.cache.enable_prefix_caching
    assert config.cache.block_size == 32
    # One context length for the model and the scheduler.
    assert config.model.max_model_len == config.scheduler.max_model_len == 512


def test_defaults_take_the_models_context_length(tiny_model_dir):
    config = EngineArgs(model=str(tiny_model_dir)).create_engine_config()
    assert config.scheduler.max_model_len == config.model.max_model_len == 4096
    assert config.model.eos_token_ids  # from generation_config.json


def test_bad_values_are_config_errors(tiny_model_dir):
    with pytest.raises(ConfigError, match="block_size"):
        EngineArgs(model=str(tiny_model_dir), block_size=12).create_engine_config()
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        EngineArgs(
            model=str(tiny_model_dir), policy="static", max_num_batched_tokens=2048
        ).create_engine_config()
    with pytest.raises(ConfigError, match="not found"):
        EngineArgs(model="/nonexistent/model").create_engine_config()
    with pytest.raises(TypeError, match="max_num_seq"):
        engine_args_from_kwargs(str(tiny_model_dir), {"max_num_seq": 4})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tbt_slo_ms": math.nan}, "scheduler.tbt_slo_ms must be a finite number"),
        ({"tbt_slo_ms": math.inf}, "scheduler.tbt_slo_ms must be a finite number"),
        ({"step_timeout_s": math.nan}, "observability.step_timeout_s must be a finite"),
        ({"node_timeout_s": -math.inf}, "parallel.nodes.timeout_s must be a finite number"),
        ({"gpu_memory_utilization": math.nan}, "cache.gpu_memory_utilization must be a finite"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1]"),
        ({"step_timeout_s": -1.0}, "step_timeout_s must be >= 0"),
    ],
)
def test_nan_infinity_and_out_of_range_floats_are_config_errors(tiny_model_dir, kwargs, message):
    # The flags refuse these (tests/entrypoints/test_flags.py); LLM's keyword arguments reach
    # the config without a parser, and NaN passes every range check written as a comparison.
    with pytest.raises(ConfigError) as error:
        EngineArgs(model=str(tiny_model_dir), **kwargs).create_engine_config()
    assert message in str(error.value)


@pytest.mark.parametrize("policy", ["prefill-first", "orca", "static"])
def test_whole_prompt_policies_default_to_a_budget_that_holds_any_prompt(tiny_model_dir, policy):
    config = EngineArgs(model=str(tiny_model_dir), policy=policy).create_engine_config()
    assert config.scheduler.max_num_batched_tokens == config.model.max_model_len == 4096


def test_stall_free_defaults_to_a_2048_budget_and_an_explicit_one_wins(tiny_model_dir):
    assert (
        EngineArgs(model=str(tiny_model_dir))
        .create_engine_config()
        .scheduler.max_num_batched_tokens
        == 2048
    )
    explicit = EngineArgs(
        model=str(tiny_model_dir), policy="orca", max_model_len=512, max_num_batched_tokens=600
    )
    assert explicit.create_engine_config().scheduler.max_num_batched_tokens == 600


def test_the_block_size_defaults_to_what_the_attention_backend_accepts(tiny_model_dir, monkeypatch):
    import importlib.util

    import torch

    from conveyor.frontend import engine_args

    def block_size(**kwargs) -> int:
        config = EngineArgs(model=str(tiny_model_dir), **kwargs).create_engine_config()
        return config.cache.block_size

    # Here (no GPU, no flash_attn): small blocks; a forced flash-attn gets blocks it accepts.
    assert block_size() == engine_args.DEFAULT_BLOCK_SIZE == 16
    assert block_size(attention_backend="flash-attn") == 256
    assert block_size(attention_backend="flash-attn", block_size=512) == 512
    # A CUDA machine with flash_attn installed: "auto" gets 256 unless the user names a size.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a),
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert block_size() == 256
    assert block_size(block_size=32) == 32
    assert block_size(device="cpu") == 16
    assert block_size(attention_backend="torch") == 16


def test_the_attention_backend_flag_reaches_the_config_and_is_checked(tiny_model_dir):
    parser = add_engine_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(tiny_model_dir), "--attention-backend", "torch"])
    assert EngineArgs.from_cli(args).create_engine_config().attention_backend == "torch"
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "xformers"])
    with pytest.raises(ConfigError, match="attention_backend must be one of"):
        EngineArgs(model=str(tiny_model_dir), attention_backend="xformers").create_engine_config()


def test_enforce_eager_reaches_the_config(tiny_model_dir):
    parser = add_engine_args(argparse.ArgumentParser())
    default = EngineArgs.from_cli(parser.parse_args(["--model", str(tiny_model_dir)]))
    assert not default.create_engine_config().enforce_eager
    args = parser.parse_args(["--model", str(tiny_model_dir), "--enforce-eager"])
    assert EngineArgs.from_cli(args).create_engine_config().enforce_eager
    assert engine_args_from_kwargs(None, {"enforce_eager": True}).enforce_eager


def test_the_tbt_slo_flag_reaches_the_scheduler_config(tiny_model_dir):
    parser = add_engine_args(argparse.ArgumentParser())
    default = EngineArgs.from_cli(parser.parse_args(["--model", str(tiny_model_dir)]))
    assert default.create_engine_config().scheduler.tbt_slo_ms is None
    args = parser.parse_args(["--model", str(tiny_model_dir), "--tbt-slo-ms", "120"])
    assert EngineArgs.from_cli(args).create_engine_config().scheduler.tbt_slo_ms == 120.0
    with pytest.raises(ConfigError, match="stall-free"):
        EngineArgs(model=str(tiny_model_dir), policy="orca", tbt_slo_ms=50.0).create_engine_config()


def test_quantization_is_checked_and_auto_means_the_cpu(tiny_model_dirs):
    model = str(tiny_model_dirs["qwen3"])
    config = EngineArgs(model=model, quantization="int8").create_engine_config()
    assert config.model.quantization == "int8" and config.device == "cpu"
    assert EngineArgs(model=model).create_engine_config().device == "auto"
    with pytest.raises(ConfigError, match="quantization 'fp8', but the checkpoint is not quant"):
        EngineArgs(model=model, quantization="fp8").create_engine_config()
    with pytest.raises(ConfigError, match="quantization must be one of int8.*'int3'"):
        EngineArgs(model=model, quantization="int3").create_engine_config()
    for device in ("cuda", "cuda:1", "mps"):
        with pytest.raises(ConfigError, match=f"runs on CPU only, not '{device}'"):
            EngineArgs(model=model, quantization="int8", device=device).create_engine_config()
    for method in ("int8", "int4"):
        with pytest.raises(ConfigError, match=f"LoRA adapters .* over {method}-quantized"):
            EngineArgs(model=model, quantization=method, enable_lora=True).create_engine_config()


@x86_only
def test_a_cpu_isa_typo_fails_the_config_before_any_process_starts(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "avx512")
    with pytest.raises(ConfigError, match="CONVEYOR_CPU_ISA='avx512' is not one of native, avx2"):
        EngineArgs(model=str(tiny_model_dir)).create_engine_config()
    monkeypatch.setenv("CONVEYOR_CPU_ISA", "avx2")
    assert EngineArgs(model=str(tiny_model_dir)).create_engine_config().device == "auto"
