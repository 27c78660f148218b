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
    # Qwen3-0.6B's shapes (about 0.6 B parameters, tied embeddings, bfloat16 on disk): what
    # `conveyor gpu-check` measures on a GPU and the CUDA tests run at head_dim 128. Qwen3 only.
    "qwen3-0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
    ),
}
# What the qwen3-0.6b size sets beyond SIZES, as Qwen3-0.6B's config.json has it.
QWEN3_0_6B_EXTRA = {
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
}
# The stdlib corpus trains at most about this many tokens; a larger vocabulary gets a tokenizer of
# this size, its other embedding rows unused (as Qwen's own 151,936 rows hold 151,669 tokens).
MAX_TOKENIZER_VOCAB = 8192
ARCHITECTURES = {
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "llama": ("LlamaForCausalLM", "llama"),
    # Mistral 7B v0.1's shape: every layer behind a sliding window.
    "mistral": ("MistralForCausalLM", "mistral"),
    # Phi-3's checkpoint layout (fused qkv_proj and gate_up_proj tensors), every layer behind a
    # window as in Phi-3-mini-4k, and Phi-4-mini's partial rotary (3/4 of each head rotates).
    "phi3": ("Phi3ForCausalLM", "phi3"),
    # Gemma 3 text: (1 + w) norms, four per layer, GeGLU, scaled embedding, two sliding-window
    # layers then a global one, each kind with its own RoPE.
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    # Gemma 2: Gemma 3's block without q/k norms, one RoPE, and a soft-cap on attention logits.
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    # Mixtures of experts: Qwen3-MoE (a dense first layer, sparse after) and Mixtral.
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    # gpt-oss: attention sinks, sliding and global layers alternating, a router with a bias and
    # experts with biases stored in MXFP4, as the released checkpoints are.
    "gpt_oss": ("GptOssForCausalLM", "gpt_oss"),
}
# The generated windows: short, so tests run prompts and outputs several times longer, and not a
# multiple of any block size the tests use, so a window edge falls inside a block.
MISTRAL_SLIDING_WINDOW = 20
PHI3_SLIDING_WINDOW = 20
GEMMA3_SLIDING_WINDOW = 24
GEMMA3_GLOBAL_EVERY = 3  # every third layer global (real Gemma 3: every sixth)
GPT_OSS_SLIDING_WINDOW = 20
MAX_POSITION_EMBEDDINGS = 4096

# Standard deviations, as multiples of 1/sqrt(fan_in). See the module docstring. Measured on tiny
# Qwen3, 32 greedy steps from random prompts: with gains 3/1/2 (O/down/QK) the model repeated the
# previous token in 21 of 32 steps; with these, in about 1, and 30 of 32 tokens were distinct.
QK_GAIN = 3.0  # query/key projections without a q/k norm: logit spread ~ QK_GAIN**2
QK_NORM_GAIN = 3.0  # q/k norm weights (Qwen3): the same spread after normalisation
O_GAIN = 8.0  # attention output, so it outweighs the unit-scale token embedding
DOWN_GAIN = 2.0
LOGIT_SPREAD = 4.0  # standard deviation of the logits, set through the final norm
# Gemma 3 normalises each sublayer's output before its residual add; these norms' scales take the
# place of O_GAIN and DOWN_GAIN. Measured on tiny Gemma 3 as above (4 x 32 greedy steps): with 4/1
# it repeated the previous token in 23 of 128 steps, with 8/2 in 8, with these in 1.
GEMMA3_ATTENTION_OUT_SCALE = 12.0
GEMMA3_MLP_OUT_SCALE = 3.0
DENSE_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")
# Mixture-of-experts routers: the normed hidden state has unit-scale entries, so router logits
# spread ROUTER_GAIN, enough that a token's top two experts stand clear of the rest yet differ
# from token to token (measured on the tiny models: every expert is picked, none by most tokens).
ROUTER_GAIN = 2.0
NUM_EXPERTS = 8
EXPERTS_PER_TOKEN = 2


def model_config(size: str = "tiny", arch: str = "qwen3") -> dict[str, Any]:
    """The config.json of a generated model (special token ids are fixed: 0, 1, 2)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    if size in ("bench", "qwen3-0.6b") and arch != "qwen3":
        raise ValueError(f"the {size} model is Qwen3 only")
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
    if size == "qwen3-0.6b":
        config.update(QWEN3_0_6B_EXTRA)
    if arch in ("qwen3", "qwen2", "qwen3_moe"):
        config.update(use_sliding_window=False, sliding_window=None)
        config["max_window_layers"] = config["num_hidden_layers"]
    if arch == "llama":
        config["mlp_bias"] = False
    if arch == "mistral":
        config["sliding_window"] = MISTRAL_SLIDING_WINDOW
    if arch == "phi3":
        config.update(_phi3_config())
    if arch in ("gemma3", "gemma2"):
        config.update(_gemma3_config(size))
        if arch == "gemma2":
            del config["rope_local_base_freq"]
            config.update(_gemma2_changes())
        del config["hidden_act"]  # Gemma names it hidden_activation
    if arch in ("qwen3_moe", "mixtral"):
        config.update(_moe_config(arch, config["intermediate_size"]))
    if arch == "gpt_oss":
        config.update(_gpt_oss_config(config["num_hidden_layers"]))
    return config


def _gpt_oss_config(num_layers: int) -> dict[str, Any]:
    return {
        "num_local_experts": NUM_EXPERTS,
        "num_experts_per_tok": EXPERTS_PER_TOKEN,
        "sliding_window": GPT_OSS_SLIDING_WINDOW,
        # Sliding first, then global, as transformers' default for gpt-oss.
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ],
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        },
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
        "pad_token_id": 0,
        # What released checkpoints say; transformers unpacks the experts when it loads.
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },
    }


def _moe_config(arch: str, intermediate_size: int) -> dict[str, Any]:
    common = {
        "num_experts_per_tok": EXPERTS_PER_TOKEN,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,  # as in the released models
    }
    if arch == "mixtral":
        return {**common, "num_local_experts": NUM_EXPERTS, "router_jitter_noise": 0.0}
    # Layer 0 dense (intermediate_size wide), the rest sparse: both MLP kinds are exercised.
    return {
        **common,
        "num_experts": NUM_EXPERTS,
        "moe_intermediate_size": intermediate_size // 4,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
    }


def _phi3_config() -> dict[str, Any]:
    return {
        "sliding_window": PHI3_SLIDING_WINDOW,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "pad_token_id": 0,  # Phi3Config's default (32000) is outside the generated vocabulary
        "tie_word_embeddings": False,
    }


def _gemma3_config(size: str) -> dict[str, Any]:
    num_layers = 3 if size == "tiny" else SIZES[size]["num_hidden_layers"]
    layer_types = [
        "full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
        for i in range(num_layers)
    ]
    # The Hub's (transformers 4) spelling of the two RoPE bases, as released checkpoints have it.
    return {
        "num_hidden_layers": num_layers,
        "layer_types": layer_types,
        "sliding_window": GEMMA3_SLIDING_WINDOW,
        "hidden_activation": "gelu_pytorch_tanh",
        # Not head_dim (16), so a model that scales by head_dim ** -0.5 shows.
        "query_pre_attn_scalar": 32,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},  # global layers, as Gemma 3 4B+
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "pad_token_id": 0,
    }


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
    qk_norm = config["model_type"] in ("qwen3", "qwen3_moe")
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


def _fused_phi3_weights(
    tensors: dict[str, torch.Tensor], num_layers: int
) -> dict[str, torch.Tensor]:
    """Phi-3's checkpoint layout: [q; k; v] as one qkv_proj, [gate; up] as one gate_up_proj."""
    fused = dict(tensors)
    groups = {
        "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    }
    for index in range(num_layers):
        for target, parts in groups.items():
            prefix = f"model.layers.{index}.{target.split('.')[0]}."
            rows = [fused.pop(f"{prefix}{part}.weight") for part in parts]
            fused[f"model.layers.{index}.{target}.weight"] = torch.cat(rows)
    return fused


def _gemma2_changes() -> dict[str, Any]:
    return {
        "rope_scaling": None,
        "rope_theta": 10000.0,
        # Low enough that the tiny model's attention logits (spread ~QK_GAIN**2) reach it, so a
        # missing cap shows (released Gemma 2: 50 on attention, 30 on the final logits).
        "attn_logit_softcapping": 8.0,
        "final_logit_softcapping": 30.0,
    }


def _gemma3_layer_weights(
    config: dict[str, Any], generator: torch.Generator
) -> dict[str, torch.Tensor]:
    # Gemma's norms scale by (1 + w): each w is the intended scale minus one. The attention and
    # MLP outputs are normalised before their residual adds, so those norms (not the output
    # projections) set how much each adds: attention outweighs the unit-scale embedding.
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    # Gemma 3's q/k norms set the spread of the attention logits; Gemma 2 has none, so its
    # projections do, as the Llama-style families' do.
    qk_norm = config["model_type"] == "gemma3_text"
    qk_std = (1.0 if qk_norm else QK_GAIN) / math.sqrt(hidden)

    def norm(size: int, scale: float) -> torch.Tensor:
        return _around((size,), scale, generator) - 1.0

    weights = {
        "input_layernorm.weight": norm(hidden, 1.0),
        "self_attn.q_proj.weight": _normal((q_size, hidden), qk_std, generator),
        "self_attn.k_proj.weight": _normal((kv_size, hidden), qk_std, generator),
        "self_attn.v_proj.weight": _normal((kv_size, hidden), 1 / math.sqrt(hidden), generator),
        "self_attn.o_proj.weight": _normal((hidden, q_size), 1 / math.sqrt(q_size), generator),
    }
    if qk_norm:
        weights["self_attn.q_norm.weight"] = norm(head_dim, QK_NORM_GAIN)
        weights["self_attn.k_norm.weight"] = norm(head_dim, QK_NORM_GAIN)
    return weights | {
        "post_attention_layernorm.weight": norm(hidden, GEMMA3_ATTENTION_OUT_SCALE),
        "pre_feedforward_layernorm.weight": norm(hidden, 1.0),
        "mlp.gate_proj.weight": _normal((inter, hidden), 1 / math.sqrt(hidden), generator),
        "mlp.up_proj.weight": _normal((inter, hidden), 1 / math.sqrt(hidden), generator),
        "mlp.down_proj.weight": _normal((hidden, inter), 1 / math.sqrt(inter), generator),
        "post_feedforward_layernorm.weight": norm(hidden, GEMMA3_MLP_OUT_SCALE),
    }


def _gemma3_weights(config: dict[str, Any], generator: torch.Generator) -> dict[str, torch.Tensor]:
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    # The model multiplies the embedding by sqrt(hidden): rows of std 1/sqrt(hidden) enter the
    # residual stream at unit scale. The tied head's rows are then of norm ~1, so the final norm
    # itself scales to LOGIT_SPREAD.
    tensors = {"model.embed_tokens.weight": _normal((vocab, hidden), hidden**-0.5, generator)}
    for index in range(config["num_hidden_layers"]):
        for name, tensor in _gemma3_layer_weights(config, generator).items():
            tensors[f"model.layers.{index}.{name}"] = tensor
    tensors["model.norm.weight"] = _around((hidden,), LOGIT_SPREAD, generator) - 1.0
    return tensors


def _sparse_mlp_weights(
    tensors: dict[str, torch.Tensor], config: dict[str, Any], generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """The sparse layers' dense MLP replaced by a router and experts, under the Hub's names."""
    mixtral = config["model_type"] == "mixtral"
    block, (gate, up, down) = (
        ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", DENSE_MLP_PARTS)
    )
    num_experts = config["num_local_experts" if mixtral else "num_experts"]
    inter = config["intermediate_size" if mixtral else "moe_intermediate_size"]
    hidden = config["hidden_size"]
    sparse = dict(tensors)
    for index in range(config["num_hidden_layers"]):
        if index in config.get("mlp_only_layers", []):
            continue
        layer = f"model.layers.{index}"
        for part in DENSE_MLP_PARTS:
            del sparse[f"{layer}.mlp.{part}.weight"]
        router = _normal((num_experts, hidden), ROUTER_GAIN / math.sqrt(hidden), generator)
        sparse[f"{layer}.{block}.gate.weight"] = router
        for expert in range(num_experts):
            prefix = f"{layer}.{block}.experts.{expert}"
            sparse[f"{prefix}.{gate}.weight"] = _normal((inter, hidden), hidden**-0.5, generator)
            sparse[f"{prefix}.{up}.weight"] = _normal((inter, hidden), hidden**-0.5, generator)
            down_std = DOWN_GAIN / math.sqrt(inter)
            sparse[f"{prefix}.{down}.weight"] = _normal((hidden, inter), down_std, generator)
    return sparse


def make_weights(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face tensor names, the same for the same config and seed."""
    generator = torch.Generator().manual_seed(seed)
    if config["model_type"] in ("gemma3_text", "gemma2"):
        return {name: t.contiguous() for name, t in _gemma3_weights(config, generator).items()}
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
    if config["model_type"] in ("qwen3_moe", "mixtral"):
        tensors = _sparse_mlp_weights(tensors, config, generator)
    if config["model_type"] == "phi3":
        tensors = _fused_phi3_weights(tensors, config["num_hidden_layers"])
    if config["model_type"] == "gpt_oss":
        tensors = _gpt_oss_weights(tensors, config, generator)
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


# RMS of a uniformly random E2M1 code: sqrt(mean of the squared magnitudes 0 .. 6).
_MXFP4_CODE_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)


def _mxfp4(
    shape: tuple[int, ...], std: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [*shape[:-1], in / 32, 16] and scales whose values have about ``std``:
    uniformly random codes, each block's power of two drawn from the two around the target."""
    *rows, columns = shape
    groups = columns // 32
    blocks = torch.randint(0, 256, (*rows, groups, 16), generator=generator, dtype=torch.uint8)
    exponent = math.log2(std / _MXFP4_CODE_RMS)
    low = math.floor(exponent)
    upper = torch.rand((*rows, groups), generator=generator) < exponent - low
    scales = (127 + low + upper.to(torch.int64)).to(torch.uint8)
    return blocks, scales


def _gpt_oss_weights(
    tensors: dict[str, torch.Tensor], config: dict[str, Any], generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Biases on attention, sinks, and the MLPs replaced by routed MXFP4 experts with biases."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    num_heads, num_kv = config["num_attention_heads"], config["num_key_value_heads"]
    experts, inter = config["num_local_experts"], config["intermediate_size"]
    out = dict(tensors)
    for index in range(config["num_hidden_layers"]):
        layer = f"model.layers.{index}"
        for part in DENSE_MLP_PARTS:
            del out[f"{layer}.mlp.{part}.weight"]
        for name, size in (("q", num_heads), ("k", num_kv), ("v", num_kv), ("o", 0)):
            rows = hidden if name == "o" else size * head_dim
            out[f"{layer}.self_attn.{name}_proj.bias"] = _normal((rows,), 0.5, generator)
        # Sinks around the spread of the attention logits: some heads often attend "nowhere".
        out[f"{layer}.self_attn.sinks"] = _normal((num_heads,), 2.0, generator) + 2.0
        router_std = ROUTER_GAIN / math.sqrt(hidden)
        out[f"{layer}.mlp.router.weight"] = _normal((experts, hidden), router_std, generator)
        out[f"{layer}.mlp.router.bias"] = _normal((experts,), 0.5, generator)
        prefix = f"{layer}.mlp.experts"
        blocks, scales = _mxfp4((experts, 2 * inter, hidden), hidden**-0.5, generator)
        out[f"{prefix}.gate_up_proj_blocks"], out[f"{prefix}.gate_up_proj_scales"] = blocks, scales
        out[f"{prefix}.gate_up_proj_bias"] = _normal((experts, 2 * inter), 0.5, generator)
        blocks, scales = _mxfp4((experts, hidden, inter), DOWN_GAIN / math.sqrt(inter), generator)
        out[f"{prefix}.down_proj_blocks"], out[f"{prefix}.down_proj_scales"] = blocks, scales
        out[f"{prefix}.down_proj_bias"] = _normal((experts, hidden), 0.5, generator)
    return out


def write_model_dir(
    out_dir: str | os.PathLike[str], size: str = "tiny", arch: str = "qwen3", seed: int = 0
) -> Path:
    """Write a complete model directory (the directory must not exist or be empty)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    config = model_config(size, arch)
    num_tokens = min(config["vocab_size"], MAX_TOKENIZER_VOCAB)
    special_ids = write_tokenizer(out, num_tokens, config["max_position_embeddings"])
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
    weights = make_weights(config, seed)
    if config["torch_dtype"] != "float32":  # the weights are drawn in float32, then rounded
        dtype = getattr(torch, config["torch_dtype"])
        weights = {name: tensor.to(dtype) for name, tensor in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
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
