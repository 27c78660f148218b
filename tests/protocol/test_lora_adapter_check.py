"""The check of a PEFT adapter folder against the base model, and the LoRA limits.

Folders are written by hand here (a config and a safetensors file of the right or wrong
shapes), so every refusal is tested for its message without PEFT or a model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conveyor.protocol.lora import AdapterError, LoRAConfig, lora_config_problem, read_adapter

MODEL = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
}
PREFIX = "base_model.model.model.layers"


def _write(folder: Path, config: dict, tensors: dict[str, tuple[int, int]], model=MODEL) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    save_file(
        {k: torch.zeros(shape) for k, shape in tensors.items()},
        folder / "adapter_model.safetensors",
    )
    model_dir = folder / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(model))
    return folder


def _q_proj(rank: int, layer: int = 0, in_dim: int = 32) -> dict[str, tuple[int, int]]:
    return {
        f"{PREFIX}.{layer}.self_attn.q_proj.lora_A.weight": (rank, in_dim),
        f"{PREFIX}.{layer}.self_attn.q_proj.lora_B.weight": (32, rank),
    }


def test_a_good_adapter_gives_its_rank_scale_and_shapes(tmp_path):
    tensors = {
        **_q_proj(4),
        f"{PREFIX}.1.mlp.down_proj.lora_A.weight": (4, 48),
        f"{PREFIX}.1.mlp.down_proj.lora_B.weight": (32, 4),
    }
    folder = _write(tmp_path / "a", {"r": 4, "lora_alpha": 8}, tensors)
    spec = read_adapter(folder, folder / "model", max_lora_rank=8)
    assert (spec.rank, spec.scale) == (4, 2.0)
    assert spec.shapes[(1, "down_proj", "A")] == (4, 48)
    rslora = _write(tmp_path / "b", {"r": 4, "lora_alpha": 8, "use_rslora": True}, tensors)
    assert read_adapter(rslora, rslora / "model", 8).scale == pytest.approx(8 / math.sqrt(4))


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        ({"r": 16}, _q_proj(16), "over --max-lora-rank 8"),
        ({"r": 4}, _q_proj(4, in_dim=31), "has shape [4, 31]"),
        ({"r": 4}, _q_proj(4, layer=5), "names no layer"),
        ({"r": 4, "use_dora": True}, _q_proj(4), "DoRA"),
        ({"r": 4, "modules_to_save": ["lm_head"]}, _q_proj(4), "modules_to_save"),
        ({"r": 4, "bias": "all"}, _q_proj(4), "bias"),
        ({"r": 4, "rank_pattern": {"q_proj": 2}}, _q_proj(4), "rank_pattern"),
        ({"r": 4}, {**_q_proj(4), "base_model.model.lm_head.lora_A.weight": (4, 32)}, "LM head"),
        (
            {"r": 4},
            {f"{PREFIX}.0.mlp.experts.3.up_proj.lora_A.weight": (4, 32)},
            "mixture-of-experts",
        ),
        ({"r": 4}, {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": (4, 32)}, "no lora_B"),
        ({"r": 4, "peft_type": "IA3"}, _q_proj(4), "not LoRA"),
    ],
    ids=[
        "rank",
        "shape",
        "layer",
        "dora",
        "modules_to_save",
        "bias",
        "rank_pattern",
        "lm_head",
        "experts",
        "half",
        "ia3",
    ],
)
def test_a_bad_adapter_is_refused_with_its_reason(tmp_path, config, tensors, message):
    folder = _write(tmp_path / "bad", config, tensors)
    with pytest.raises(AdapterError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_adapter(folder, folder / "model", max_lora_rank=8)


def test_mlp_lora_on_a_mixture_of_experts_model_is_refused(tmp_path):
    tensors = {
        f"{PREFIX}.0.mlp.up_proj.lora_A.weight": (4, 32),
        f"{PREFIX}.0.mlp.up_proj.lora_B.weight": (48, 4),
    }
    folder = _write(tmp_path / "moe", {"r": 4}, tensors, {**MODEL, "num_experts": 4})
    with pytest.raises(AdapterError, match="attention only"):
        read_adapter(folder, folder / "model", max_lora_rank=8)


def test_a_missing_folder_or_file_is_named(tmp_path):
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter(tmp_path / "nowhere", tmp_path, 8)
    folder = _write(tmp_path / "a", {"r": 4}, _q_proj(4))
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        read_adapter(folder, folder / "model", 8)


def test_lora_limits_are_checked():
    assert lora_config_problem(LoRAConfig()) is None
    assert "max_loras" in lora_config_problem(LoRAConfig(max_loras=0))
    assert "max_cpu_loras" in lora_config_problem(LoRAConfig(max_loras=4, max_cpu_loras=2))
    assert "lora_dtype" in lora_config_problem(LoRAConfig(lora_dtype="int4"))
