"""Loading a Hugging Face model directory: sharded weights, dtypes, and every clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor.worker.loader import ModelLoadError, load_model, resolve_dtype

CPU = torch.device("cpu")


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, **changes) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


def shard(model_dir: Path, num_shards: int) -> None:
    """Rewrite model.safetensors as shards with an index, the way large checkpoints ship."""
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[i::num_shards]}
        save_file(part, model_dir / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_sharded_checkpoint_loads_the_same_as_one_file(tiny_model_dirs, tmp_path: Path, arch):
    single = load_model(tiny_model_dirs[arch], torch.float32, CPU)
    sharded_dir = copy_model(tiny_model_dirs[arch], tmp_path / "sharded")
    shard(sharded_dir, 3)
    sharded = load_model(sharded_dir, torch.float32, CPU)
    expected = dict(single.named_parameters())
    got = dict(sharded.named_parameters())
    assert got.keys() == expected.keys()
    for name, param in got.items():
        assert torch.equal(param, expected[name]), name


def test_parameters_are_built_in_the_requested_dtype(tiny_model_dir: Path):
    model = load_model(tiny_model_dir, torch.bfloat16, CPU)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # The RoPE table stays float32: positions in the thousands need its precision.
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training
    # A tied head is the embedding itself, not a copy.
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_head_is_loaded_from_its_own_tensor(tiny_model_dirs):
    model = load_model(tiny_model_dirs["llama"], torch.float32, CPU)
    tensors = load_file(tiny_model_dirs["llama"] / "model.safetensors")
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_missing_directory(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="model directory not found"):
        load_model(tmp_path / "nowhere", torch.float32, CPU)


def test_directory_without_config(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(tmp_path, torch.float32, CPU)


def test_unsupported_architecture_lists_the_supported_ones(tiny_model_dir: Path, tmp_path: Path):
    model_dir = copy_model(tiny_model_dir, tmp_path / "m")
    edit_config(model_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="'GPT2LMHeadModel' is not supported") as error:
        load_model(model_dir, torch.float32, CPU)
    for name in ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"):
        assert name in str(error.value)


def test_no_safetensors(tiny_model_dir: Path, tmp_path: Path):
    model_dir = copy_model(tiny_model_dir, tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(model_dir, torch.float32, CPU)


def test_index_naming_an_absent_shard(tiny_model_dir: Path, tmp_path: Path):
    model_dir = copy_model(tiny_model_dir, tmp_path / "m")
    shard(model_dir, 2)
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load_model(model_dir, torch.float32, CPU)


def test_missing_tensors_are_named_in_the_checkpoint_s_terms(tiny_model_dir: Path, tmp_path: Path):
    model_dir = copy_model(tiny_model_dir, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["model.norm.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing tensors") as error:
        load_model(model_dir, torch.float32, CPU)
    message = str(error.value)
    assert "model.layers.1.self_attn.k_proj.weight" in message
    assert "model.norm.weight" in message
    # The other parts of the fused qkv parameter are present, so they are not blamed.
    assert "q_proj" not in message and "v_proj" not in message


def test_unexpected_and_misshapen_tensors(tiny_model_dir: Path, tmp_path: Path):
    model_dir = copy_model(tiny_model_dir, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.mlp.experts.0.weight"] = torch.zeros(2)
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match="experts.0.weight"):
        load_model(model_dir, torch.float32, CPU)

    del tensors["model.layers.0.mlp.experts.0.weight"]
    tensors["model.norm.weight"] = torch.zeros(3)
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.norm.weight: shape mismatch"):
        load_model(model_dir, torch.float32, CPU)


def test_unsupported_settings_in_config_are_load_errors(tiny_model_dir: Path, tmp_path: Path):
    model_dir = copy_model(tiny_model_dir, tmp_path / "m")
    edit_config(model_dir, hidden_act="gelu")
    with pytest.raises(ModelLoadError, match="hidden_act 'gelu' is not supported"):
        load_model(model_dir, torch.float32, CPU)
    with pytest.raises(ModelLoadError, match="does not split evenly across 3 ranks"):
        load_model(tiny_model_dir, torch.float32, CPU, tp_rank=0, tp_size=3)


def test_rotary_inv_freq_in_old_checkpoints_is_skipped(tiny_model_dir: Path, tmp_path: Path):
    model_dir = copy_model(tiny_model_dir, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, model_dir / "model.safetensors")
    load_model(model_dir, torch.float32, CPU)


@pytest.mark.parametrize(
    ("name", "device", "config_dtype", "expected"),
    [
        ("auto", "cpu", "bfloat16", torch.float32),
        ("auto", "cuda", "bfloat16", torch.bfloat16),
        ("auto", "cuda", "float16", torch.float16),
        ("auto", "cuda", "float32", torch.bfloat16),
        ("bf16", "cpu", "float32", torch.bfloat16),
        ("float16", "cuda", "float32", torch.float16),
        ("float32", "cuda", "bfloat16", torch.float32),
    ],
)
def test_resolve_dtype(tmp_path: Path, name, device, config_dtype, expected):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": config_dtype}))
    assert resolve_dtype(name, torch.device(device), tmp_path) == expected


def test_resolve_dtype_reads_the_transformers_5_key_and_rejects_unknown_names(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16"}))
    assert resolve_dtype("auto", "cuda", tmp_path) == torch.float16
    with pytest.raises(ModelLoadError, match="unknown dtype 'float8'"):
        resolve_dtype("float8", "cpu")
