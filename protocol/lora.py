"""LoRA adapters: the configuration, a request's adapter, and the check of a PEFT adapter folder.

Shared by every process (standard library and msgspec only). A PEFT adapter is a folder with
``adapter_config.json`` and ``adapter_model.safetensors``; ``read_adapter`` reads the config and
the safetensors header (names and shapes, never the tensors) and checks them against the base
model's ``config.json`` and the server's limits, so a bad adapter is refused with its reason in
the process that was asked for it (a 400, or a refusal at start-up), before any engine sees it.
The worker loads the tensors themselves (worker/lora/).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import msgspec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# PEFT's module names -> (our fused layer, the part of it, how many parts the layer has).
# q/k/v live in one qkv_proj, gate/up in one gate_up_proj (the order of the parts there).
TARGETS: dict[str, tuple[str, int, int]] = {
    "q_proj": ("qkv_proj", 0, 3),
    "k_proj": ("qkv_proj", 1, 3),
    "v_proj": ("qkv_proj", 2, 3),
    "o_proj": ("o_proj", 0, 1),
    "gate_proj": ("gate_up_proj", 0, 2),
    "up_proj": ("gate_up_proj", 1, 2),
    "down_proj": ("down_proj", 0, 1),
}
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$"
)
_MODULE_OF = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message says why (a 400 or a start-up refusal)."""


class LoRAConfig(msgspec.Struct, frozen=True):
    """``--enable-lora`` and its limits (``EngineConfig.lora``; None: no adapters)."""

    # Adapters one step may mix (the worker's slots).
    max_loras: int = 1
    # The largest rank an adapter may have: every slot is this wide.
    max_lora_rank: int = 16
    # Adapters a worker keeps loaded in host memory beside its slots (an LRU); None: max_loras.
    max_cpu_loras: int | None = None
    # The slots' dtype: "auto" is the model's.
    lora_dtype: str = "auto"

    @property
    def num_cpu_loras(self) -> int:
        return max(self.max_cpu_loras or 0, self.max_loras)


def lora_config_problem(config: LoRAConfig) -> str | None:
    """What is wrong with the LoRA limits, or None."""
    if config.max_loras < 1:
        return f"max_loras must be at least 1, got {config.max_loras}"
    if config.max_lora_rank < 1:
        return f"max_lora_rank must be at least 1, got {config.max_lora_rank}"
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        return (
            f"max_cpu_loras ({config.max_cpu_loras}) must be at least max_loras "
            f"({config.max_loras})"
        )
    if config.lora_dtype not in LORA_DTYPES:
        return f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {config.lora_dtype!r}"
    return None


class LoRARequest(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A request's adapter, as vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``.

    The engine tells adapters apart by all three: a folder loaded again under a new id (the HTTP
    route's ``load_inplace``) is a new adapter, its weights read again and its KV its own.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def key(self) -> str:
        return f"{self.lora_name}\0{self.lora_int_id}\0{self.lora_path}"


class LoRALoad(msgspec.Struct, array_like=True, gc=False):
    """A slot the workers fill with an adapter before the step runs (engine core -> workers)."""

    slot: int
    # The engine's own id of the adapter (``NewRequestData.lora_id``); 0 is the base model.
    lora_id: int
    path: str


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter folder holds: its rank, scale and the shape of every A and B."""

    path: str
    rank: int
    scale: float
    # (layer index, PEFT module name, "A" or "B") -> shape.
    shapes: dict[tuple[int, str, str], tuple[int, ...]]


def read_adapter(path: str | Path, model_dir: str | Path, max_lora_rank: int) -> AdapterSpec:
    """Check a PEFT adapter folder against the base model; AdapterError says what is wrong."""
    folder = Path(path)
    if not (folder / ADAPTER_CONFIG).is_file():
        raise AdapterError(f"LoRA adapter {str(path)!r}: no {ADAPTER_CONFIG} there")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise AdapterError(f"LoRA adapter {str(path)!r}: no {ADAPTER_WEIGHTS} there")
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        shapes = _safetensors_shapes(folder / ADAPTER_WEIGHTS)
    except (OSError, ValueError, struct.error) as error:
        raise AdapterError(f"LoRA adapter {str(path)!r}: unreadable ({error})") from None
    rank, scale = _check_config(config, max_lora_rank)
    model = json.loads((Path(model_dir) / "config.json").read_text())
    tensors = _check_tensors(shapes, rank, model)
    return AdapterSpec(str(path), rank, scale, tensors)


def _check_config(config: dict, max_lora_rank: int) -> tuple[int, float]:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not LoRA")
    if config.get("target_parameters"):
        # PEFT's way to adapt fused expert weights (Qwen3-MoE's gate_up_proj), with a
        # rank_pattern of its own: named first, as the reason that matters.
        raise AdapterError(
            f"target_parameters {config['target_parameters']}: LoRA on mixture-of-experts "
            "experts (or any raw parameter) is not supported"
        )
    rank = config.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"adapter rank r={rank!r} is not a positive integer")
    if rank > max_lora_rank:
        raise AdapterError(f"adapter rank {rank} is over --max-lora-rank {max_lora_rank}")
    refused = {
        "use_dora": "DoRA adapters",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "modules_to_save": "modules_to_save (fully trained copies of base layers)",
        "layers_to_transform": "layers_to_transform",
        "fan_in_fan_out": "fan_in_fan_out",
    }
    for key, what in refused.items():
        if config.get(key):
            raise AdapterError(f"{what} are not supported ({key} is set)")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"adapter bias {config.get('bias')!r} is not supported (only 'none')")
    alpha = config.get("lora_alpha", rank)
    if config.get("use_rslora"):
        return rank, alpha / math.sqrt(rank)
    return rank, alpha / rank


def _check_tensors(
    shapes: dict[str, tuple[int, ...]], rank: int, model: dict
) -> dict[tuple[int, str, str], tuple[int, ...]]:
    dims = _module_dims(model)
    num_layers = model["num_hidden_layers"]
    is_moe = bool(model.get("num_experts") or model.get("num_local_experts"))
    found: dict[tuple[int, str, str], tuple[int, ...]] = {}
    for name, shape in shapes.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise AdapterError(f"adapter tensor {name!r}: {_why_refused(name)}")
        layer, kind, module, which = int(match[1]), match[2], match[3], match[4]
        if kind != _MODULE_OF[module] or layer >= num_layers:
            raise AdapterError(f"adapter tensor {name!r} names no layer of the base model")
        if is_moe and kind == "mlp":
            raise AdapterError(
                f"adapter tensor {name!r}: LoRA on a mixture-of-experts model's MLP is not "
                "supported (attention only)"
            )
        out_dim, in_dim = dims[module]
        expected = (rank, in_dim) if which == "A" else (out_dim, rank)
        if tuple(shape) != expected:
            raise AdapterError(
                f"adapter tensor {name!r} has shape {list(shape)}, the base model needs "
                f"{list(expected)}: an adapter of another base model, or of another rank"
            )
        found[(layer, module, which)] = tuple(shape)
    for layer, module, which in found:
        other = "B" if which == "A" else "A"
        if (layer, module, other) not in found:
            raise AdapterError(
                f"adapter has lora_{which} of layer {layer} {module} but no lora_{other}"
            )
    if not found:
        raise AdapterError("adapter holds no LoRA tensor")
    return found


def _why_refused(name: str) -> str:
    if ".experts." in name:
        return "LoRA on mixture-of-experts experts is not supported"
    if "embed_tokens" in name or "lm_head" in name or "lora_embedding" in name:
        return "LoRA on the embeddings or the LM head is not supported"
    if "lora_magnitude" in name:
        return "DoRA adapters are not supported"
    return "not a LoRA tensor of q/k/v/o_proj or gate/up/down_proj"


def parse_tensor_name(name: str) -> tuple[int, str, str] | None:
    """A PEFT tensor name -> (layer index, module, "A" or "B"); None for anything else."""
    match = _TENSOR_NAME.match(name)
    if match is None or _MODULE_OF[match[3]] != match[2]:
        return None
    return int(match[1]), match[3], match[4]


def _module_dims(model: dict) -> dict[str, tuple[int, int]]:
    """(output, input) features of every adaptable projection of the base model."""
    hidden = model["hidden_size"]
    heads = model["num_attention_heads"]
    head_dim = model.get("head_dim") or hidden // heads
    kv = model.get("num_key_value_heads") or heads
    inter = model.get("intermediate_size", 0)
    return {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv * head_dim, hidden),
        "v_proj": (kv * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the file's header alone (8-byte length, then JSON)."""
    with path.open("rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        if length > 100 << 20:
            raise ValueError("safetensors header over 100 MiB")
        header = json.loads(file.read(length))
    return {name: tuple(info["shape"]) for name, info in header.items() if name != "__metadata__"}
