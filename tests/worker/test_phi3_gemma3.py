"""The pieces Phi-3 and Gemma 3 add, against transformers or against the parts they replace:
the generated checkpoints, fused checkpoint tensors (one rank and tensor-parallel slices),
partial rotary and LongRoPE, Gemma's RMSNorm and GeGLU, and the settings refused at load.
Token-level parity through the engine is tests/frontend/test_parity_phi3_gemma3.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Phi3Config
from transformers.activations import ACT2FN
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

import benchmarks.__main__
from benchmarks.fixtures.model_maker import ensure_model, write_model_dir
from conveyor.protocol.config import ConfigError, load_model_config
from conveyor.worker.layers import (
    GeluAndMul,
    GemmaRMSNorm,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RotaryEmbedding,
)
from conveyor.worker.loader import ModelLoadError, load_model
from conveyor.worker.models.decoder import head_dim_of, kv_sliding_window, layer_sliding_windows
from tests.worker import test_model_maker

CPU = torch.device("cpu")
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 3, 5
ARCHS = ("phi3", "gemma3", "gemma2")
CLASSES = {"phi3": "Phi3ForCausalLM", "gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_every_generated_tensor(arch: str):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        ensure_model("tiny", arch), dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # missing, unexpected, mismatched, errors
    assert type(model).__name__ == CLASSES[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_depends_on_the_whole_context(arch: str, hf_model):
    test_model_maker.test_greedy_output_depends_on_the_whole_context(
        ensure_model("tiny", arch), hf_model
    )


def test_conveyor_make_model_writes_the_new_families(tmp_path: Path, capsys):
    for arch in ARCHS:
        assert benchmarks.__main__.main(["make-model", str(tmp_path / arch), "--arch", arch]) == 0
        expected = write_model_dir(tmp_path / f"{arch}-again", "tiny", arch)
        assert (tmp_path / arch / "model.safetensors").read_bytes() == (
            expected / "model.safetensors"
        ).read_bytes()
    assert "Gemma3ForCausalLM" in capsys.readouterr().out


def _load(param: torch.nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
    param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]


@pytest.mark.parametrize("tp_size", [1, 2, 4])  # 4 ranks: each of the 2 KV heads on two ranks
def test_a_fused_qkv_tensor_loads_as_its_parts_do_on_every_rank(tp_size: int):
    gen = torch.Generator().manual_seed(0)
    parts = {
        "q": torch.randn(NUM_HEADS * HEAD_DIM, HIDDEN + 1, generator=gen),
        "k": torch.randn(NUM_KV_HEADS * HEAD_DIM, HIDDEN + 1, generator=gen),
        "v": torch.randn(NUM_KV_HEADS * HEAD_DIM, HIDDEN + 1, generator=gen),
    }
    weights = {name: part[:, :-1] for name, part in parts.items()}
    biases = {name: part[:, -1] for name, part in parts.items()}
    for rank in range(tp_size):
        layers = [
            QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, True, rank, tp_size)
            for _ in range(2)
        ]
        separate, fused = layers
        for shard_id in "qkv":
            _load(separate.weight, weights[shard_id], shard_id)
            _load(separate.bias, biases[shard_id], shard_id)
        _load(fused.weight, torch.cat(list(weights.values())))
        _load(fused.bias, torch.cat(list(biases.values())))
        assert torch.equal(fused.weight, separate.weight), rank
        assert torch.equal(fused.bias, separate.bias), rank


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_fused_gate_up_tensor_loads_as_its_parts_do_on_every_rank(tp_size: int):
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    for rank in range(tp_size):
        separate = MergedColumnParallelLinear(3, [8, 8], tp_rank=rank, tp_size=tp_size)
        fused = MergedColumnParallelLinear(3, [8, 8], tp_rank=rank, tp_size=tp_size)
        _load(separate.weight, gate, 0), _load(separate.weight, up, 1)
        _load(fused.weight, torch.cat([gate, up]))
        assert torch.equal(fused.weight, separate.weight)


def test_a_fused_tensor_of_the_wrong_size_is_refused():
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS)
    with pytest.raises(ValueError, match="fused checkpoint tensor has 21 rows, expected 24"):
        _load(layer.weight, torch.randn(21, HIDDEN))


def test_a_phi3_checkpoint_loads_each_ranks_slice_of_each_part():
    """Through the real loader: rank 1 of 2 holds the second half of q, k, v, gate and up."""
    model_dir = ensure_model("tiny", "phi3")
    tensors = load_file(model_dir / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" not in tensors  # fused on disk
    model = load_model(model_dir, torch.float32, CPU, tp_rank=1, tp_size=2)
    config = model.config
    q_rows = config.num_attention_heads * head_dim_of(config)
    kv_rows = config.num_key_value_heads * head_dim_of(config)
    q, k, v = tensors["model.layers.1.self_attn.qkv_proj.weight"].split([q_rows, kv_rows, kv_rows])
    halves = [part[part.shape[0] // 2 :] for part in (q, k, v)]
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight, torch.cat(halves))
    gate, up = tensors["model.layers.1.mlp.gate_up_proj.weight"].chunk(2)
    rows = config.intermediate_size // 2
    expected = torch.cat([gate[rows:], up[rows:]])
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight, expected)


def test_a_missing_fused_tensor_is_named_as_the_checkpoint_names_it(tmp_path: Path):
    model_dir = tmp_path / "phi3"
    shutil.copytree(ensure_model("tiny", "phi3"), model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.qkv_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.1\.self_attn\.qkv"):
        load_model(model_dir, torch.float32, CPU)


def test_each_familys_windows_and_what_the_kv_cache_may_free():
    from transformers import AutoConfig

    phi3 = AutoConfig.from_pretrained(ensure_model("tiny", "phi3"))
    assert layer_sliding_windows(phi3) == [20, 20]
    assert kv_sliding_window(layer_sliding_windows(phi3)) == 20
    gemma3 = AutoConfig.from_pretrained(ensure_model("tiny", "gemma3"))
    assert layer_sliding_windows(gemma3) == [24, 24, None]
    assert kv_sliding_window(layer_sliding_windows(gemma3)) is None  # the global layer keeps all


def _phi3_config(rope_scaling: dict | None = None) -> Phi3Config:
    return Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16384 if rope_scaling else 4096,
        original_max_position_embeddings=4096,
        partial_rotary_factor=0.75,
        rope_scaling=rope_scaling,
        pad_token_id=0,
    )


LONGROPE = {
    "type": "longrope",  # Phi-3's config reads the old "type" key too
    "short_factor": [1.0, 1.1, 1.3, 1.7, 2.5, 4.0],  # one per rotary frequency: 12 dims / 2
    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
}


@pytest.mark.parametrize("rope_scaling", [None, LONGROPE], ids=["default", "longrope"])
def test_partial_rotary_and_longrope_match_hf(rope_scaling):
    config = _phi3_config(rope_scaling)
    ours = RotaryEmbedding.from_config(config, 16)
    assert ours.rotary_dim == 12
    # LongRoPE is served within the original context only (short factors), where HF agrees.
    assert ours.num_positions == 4096
    positions = torch.tensor([0, 1, 7, 300, 2047, 4095])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 4, 16, generator=gen)
    k = torch.randn(len(positions), 2, 16, generator=gen)
    cos, sin = Phi3RotaryEmbedding(config)(q, positions[None])
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=1)
    our_q, our_k = ours(positions, q.flatten(1), k.flatten(1))
    torch.testing.assert_close(our_q.view_as(q), expected_q, atol=1e-5, rtol=0)
    torch.testing.assert_close(our_k.view_as(k), expected_k, atol=1e-5, rtol=0)
    assert torch.equal(our_q.view_as(q)[..., 12:], q[..., 12:])  # the rest passes through


def _phi3_with_longrope(tmp_path: Path) -> Path:
    model_dir = tmp_path / "phi3-longrope"
    shutil.copytree(ensure_model("tiny", "phi3"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(rope_scaling=LONGROPE, max_position_embeddings=16384)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def test_longrope_models_are_served_within_their_original_context(tmp_path: Path):
    model_dir = _phi3_with_longrope(tmp_path)
    assert load_model_config(model_dir).max_model_len == 4096
    with pytest.raises(ConfigError, match="between 1 and the model's 4096 .*longrope"):
        load_model_config(model_dir, max_model_len=8192)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_matches_hf(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, generator=gen).to(dtype)  # a bfloat16 model holds its weights so
    x = (torch.randn(6, 32, generator=gen) * 3).to(dtype)
    residual = torch.randn(6, 32, generator=gen).to(dtype)
    theirs = Gemma3RMSNorm(32, eps=1e-6).to(dtype).requires_grad_(False)
    theirs.weight.copy_(weight)
    ours = GemmaRMSNorm(32, eps=1e-6).to(dtype)
    _load(ours.weight, weight)
    # Half types: the same rounding as HF (scale in float32, then cast), bit for bit. float32:
    # our sum of squares is one fused reduction, equal to rounding (see rms_normalize).
    tolerance = {"atol": 0, "rtol": 0} if dtype != torch.float32 else {}
    torch.testing.assert_close(ours(x), theirs(x), **tolerance)
    normed, summed = ours(x, residual)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, theirs(x + residual), **tolerance)
    ours.process_weights_after_loading()
    torch.testing.assert_close(ours(x), theirs(x), **tolerance)
    _load(ours.weight, torch.zeros(32, dtype=dtype))  # a reload drops the derived scale
    torch.testing.assert_close(ours(x), torch.nn.functional.rms_norm(x, (32,), eps=1e-6))


def test_gelu_and_mul_is_gemmas_mlp_activation():
    x = torch.randn(5, 16) * 3
    gate, up = x.chunk(2, dim=-1)
    expected = ACT2FN["gelu_pytorch_tanh"](gate) * up
    assert torch.equal(GeluAndMul(approximate="tanh")(x), expected)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
    ],
)
def test_gemma3_settings_we_do_not_implement_are_refused_at_load(tmp_path, change, message):
    model_dir = tmp_path / "gemma3"
    shutil.copytree(ensure_model("tiny", "gemma3"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(change)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_model(model_dir, torch.float32, CPU)
