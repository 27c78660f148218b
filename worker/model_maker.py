"""Generate small random-weight models in Hugging Face format, for tests and benchmarks.

Runs in whichever process asks (tests, `conveyor make-model`, benchmarks).
The directory is what a real checkpoint looks like: config.json, generation_config.json,
model.safetensors, tokenizer files with a ChatML template; transformers loads it as it is.

Why the weights are not the usual N(0, 0.02): a tiny model with small weights has near-uniform
attention and a residual stream dominated by the last token's embedding, so it repeats its last
token whatever came before, and a broken attention still "matches" a reference. Here each matrix
gets a standard deviation chosen so that activations stay O(1) while attention logits have a
spread of several units (peaked, content-dependent attention), and the attention output outweighs
the token embedding in the residual stream. Greedy continuations then depend on the whole context.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from worker.tokenizer_maker import ENDOFTEXT, IM_END, write_tokenizer

# Bump when the weights or files generated for the same arguments change, so cached copies of
# older models are not reused.
MAKER_VERSION = 2

SIZES: dict[str, dict[str, int]] = {
    # The default model: fast enough to run hundreds of times in the test suite.
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=2048,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=768,
        vocab_size=4096,
    ),
    # Benchmarks: ~29M parameters, big enough that batching matters, small enough for a CPU.
    "bench": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=8192,
    ),
}
ARCHITECTURES = {
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "llama": ("LlamaForCausalLM", "llama"),
    # Mistral 7B v0.1's shape: every layer behind a sliding window.
    "mistral": ("MistralForCausalLM", "mistral"),
}
# The generated Mistral's window: short, so tests run prompts and outputs several times longer,
# and not a multiple of any block size the tests use, so a window edge falls inside a block.
MISTRAL_SLIDING_WINDOW = 20
MAX_POSITION_EMBEDDINGS = 4096

# Standard deviations, as multiples of 1/sqrt(fan_in). See the module docstring. Measured on tiny
# Qwen3, 32 greedy steps from random prompts: with gains 3/1/2 (O/down/QK) the model repeated the
# previous token in 21 of 32 steps; with these, in about 1, and 30 of 32 tokens were distinct.
QK_GAIN = 3.0  # query/key projections without a q/k norm: logit spread ~ QK_GAIN**2
QK_NORM_GAIN = 3.0  # q/k norm weights (Qwen3): the same spread after normalisation
O_GAIN = 8.0  # attention output, so it outweighs the unit-scale token embedding
DOWN_GAIN = 2.0
LOGIT_SPREAD = 4.0  # standard deviation of the logits, set through the final norm


def model_config(size: str = "tiny", arch: str = "qwen3") -> dict[str, Any]:
    """The config.json of a generated model (special token ids are fixed: 0, 1, 2)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    if size == "bench" and arch != "qwen3":
        raise ValueError("the bench model is Qwen3 only")
    architecture, model_type = ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        **SIZES[size],
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        # Llama gets a separate LM head so both kinds of head are exercised.
        "tie_word_embeddings": arch != "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch in ("qwen3", "qwen2"):
        config.update(use_sliding_window=False, sliding_window=None)
        config["max_window_layers"] = config["num_hidden_layers"]
    if arch == "llama":
        config["mlp_bias"] = False
    if arch == "mistral":
        config["sliding_window"] = MISTRAL_SLIDING_WINDOW
    return config


def _normal(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * std


def _around(shape: tuple[int, ...], center: float, generator: torch.Generator) -> torch.Tensor:
    # Norm weights near `center` but not equal to it, so a norm that fails to load shows.
    return center * (0.8 + 0.4 * torch.rand(shape, generator=generator))


def _layer_weights(config: dict[str, Any], generator: torch.Generator) -> dict[str, torch.Tensor]:
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    qk_norm = config["model_type"] == "qwen3"
    qk_std = (1.0 if qk_norm else QK_GAIN) / math.sqrt(hidden)
    weights = {
        "input_layernorm.weight": _around((hidden,), 1.0, generator),
        "self_attn.q_proj.weight": _normal((q_size, hidden), qk_std, generator),
        "self_attn.k_proj.weight": _normal((kv_size, hidden), qk_std, generator),
        "self_attn.v_proj.weight": _normal((kv_size, hidden), 1 / math.sqrt(hidden), generator),
        "self_attn.o_proj.weight": _normal((hidden, q_size), O_GAIN / math.sqrt(q_size), generator),
        "post_attention_layernorm.weight": _around((hidden,), 1.0, generator),
        "mlp.gate_proj.weight": _normal((inter, hidden), 1 / math.sqrt(hidden), generator),
        "mlp.up_proj.weight": _normal((inter, hidden), 1 / math.sqrt(hidden), generator),
        "mlp.down_proj.weight": _normal((hidden, inter), DOWN_GAIN / math.sqrt(inter), generator),
    }
    if qk_norm:
        weights["self_attn.q_norm.weight"] = _around((head_dim,), QK_NORM_GAIN, generator)
        weights["self_attn.k_norm.weight"] = _around((head_dim,), QK_NORM_GAIN, generator)
    if config["model_type"] == "qwen2":
        for name, size in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            weights[f"self_attn.{name}_proj.bias"] = _normal((size,), 0.5, generator)
    return weights


def make_weights(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face tensor names, the same for the same config and seed."""
    generator = torch.Generator().manual_seed(seed)
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    tensors = {"model.embed_tokens.weight": _normal((vocab, hidden), 1.0, generator)}
    for index in range(config["num_hidden_layers"]):
        for name, tensor in _layer_weights(config, generator).items():
            tensors[f"model.layers.{index}.{name}"] = tensor
    # Unit-scale head rows and a normed hidden state of size sqrt(hidden): scale the final norm
    # so the logits spread LOGIT_SPREAD, peaked enough to be decisive, not one-hot.
    tensors["model.norm.weight"] = _around((hidden,), LOGIT_SPREAD / math.sqrt(hidden), generator)
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = _normal((vocab, hidden), 1.0, generator)
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def write_model_dir(
    out_dir: str | os.PathLike[str], size: str = "tiny", arch: str = "qwen3", seed: int = 0
) -> Path:
    """Write a complete model directory (the directory must not exist or be empty)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    config = model_config(size, arch)
    special_ids = write_tokenizer(out, config["vocab_size"], MAX_POSITION_EMBEDDINGS)
    if (special_ids[ENDOFTEXT], special_ids[IM_END]) != (
        config["bos_token_id"],
        config["eos_token_id"],
    ):
        raise RuntimeError(f"unexpected special token ids {special_ids}")
    generation_config = {
        "bos_token_id": special_ids[ENDOFTEXT],
        "eos_token_id": [special_ids[IM_END], special_ids[ENDOFTEXT]],
        "pad_token_id": special_ids[ENDOFTEXT],
    }
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config)
    save_file(make_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def cached_model_name(size: str = "tiny", arch: str = "qwen3", seed: int = 0) -> str:
    # The fingerprint changes whenever what we would generate changes (config, generator
    # version, the Python whose stdlib the tokenizer is trained on).
    spec = json.dumps([model_config(size, arch), seed, MAKER_VERSION, sys.version_info[:2]])
    return f"{arch}-{size}-seed{seed}-{hashlib.sha256(spec.encode()).hexdigest()[:10]}"


def model_cache_dir() -> Path:
    root = os.environ.get("CONVEYOR_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "conveyor" / "models"


def ensure_model(size: str = "tiny", arch: str = "qwen3", seed: int = 0) -> Path:
    """The generated model's directory in the cache, made on first use.

    Safe for concurrent callers (pytest-xdist workers, several servers): each writes into its own
    temporary directory and renames it into place; the loser of the race keeps the winner's copy.
    """
    final = model_cache_dir() / cached_model_name(size, arch, seed)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write_model_dir(tmp, size, arch, seed)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
