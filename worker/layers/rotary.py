"""Rotary position embedding (RoPE) and the context-extension variants Qwen and Llama use.

Runs in worker processes. The cos/sin table is computed once, in float32, for every position the
model can see; a step looks rows up by ``positions`` (one per token of the flat stream), so tokens
of different requests at different positions rotate in one op. The rotation is the "neox" one of
Hugging Face's Llama/Qwen (the two halves of a head, not interleaved pairs).

Variants (``rope_type``): default, linear (positions divided by a factor), dynamic (NTK-aware: the
base grows with the context), llama3 (frequency-band-wise interpolation), yarn (band-wise
interpolation plus an attention temperature, Qwen2.5 long context), longrope (Phi-3/Phi-4 long
context: per-frequency factors; served within the original context only, see
``_longrope_inv_freq``).
With ``partial_rotary_factor`` < 1 (Phi-4-mini: 0.75) only the first part of each head rotates.

Every layer rotates by the same positions, so the model looks the angles up once per step
(``angles``) and each layer rotates its queries and keys together, in place (``rotate_``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from conveyor.worker.layers import triton_ops
from conveyor.worker.layers.cpu_ops import TokenOps, load_token_ops
from conveyor.worker.layers.norm import rms_normalize
from conveyor.worker.layers.triton_ops import use_triton_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_parameters_of(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE settings of a transformers config, whichever major version wrote it.

    transformers 5 keeps them in ``rope_parameters`` (theta included); 4.x has ``rope_theta`` and a
    ``rope_scaling`` dict whose kind is under "type" or "rope_type". A model whose layer kinds
    rotate differently (Gemma 3: "full_attention" / "sliding_attention") nests one dict per kind;
    ``layer_type`` picks one.
    """
    found = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(found or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    params["rope_theta"] = float(
        params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    )
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    params["partial_rotary_factor"] = float(
        params.get("partial_rotary_factor")
        or getattr(hf_config, "partial_rotary_factor", None)
        or 1.0
    )
    return params


def _base_inv_freq(head_dim: int, base: float | torch.Tensor) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths (beyond the original context) are slowed by `factor`, short ones are kept,
    # and the band between is interpolated smoothly.
    inv_freq = _base_inv_freq(head_dim, params["rope_theta"])
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(head_dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    base, factor = params["rope_theta"], params["factor"]
    old_len = params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits `num_rotations` times into the original context.
        return head_dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope_inv_freq(
    head_dim: int, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini) for contexts within the original one.

    transformers rotates by ``short_factor`` while the sequence fits the original context and, once
    it grows past, re-encodes the whole sequence with ``long_factor``. A KV cache cannot re-encode,
    so we serve the short half only: the engine caps max_model_len at the original context
    (protocol/config.py) and the table ends there. The attention factor is the long-context one
    all the same, as transformers applies it at every length.
    """
    base, old_len = params["rope_theta"], params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / old_len
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
        )
    short_factor = torch.tensor(params["short_factor"], dtype=torch.float32)
    if short_factor.shape != (head_dim // 2,):
        raise ValueError(
            f"longrope short_factor has {len(short_factor)} entries, not {head_dim // 2}"
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (short_factor * base**exponents), float(attention_factor)


def _dynamic_inv_freq(
    head_dim: int, params: dict[str, Any], num_positions: int, max_position: int
) -> torch.Tensor:
    """One frequency row per position: NTK base scaled for a context just reaching it.

    Hugging Face recomputes the base from the longest sequence in the batch; a token's rotation
    must not depend on its batch-mates (and cached keys keep theirs), so each position gets the
    base it has when decoded one token at a time, which is what HF computes for it then. Within
    the original context this is exactly the default RoPE.
    """
    factor, base = params["factor"], params["rope_theta"]
    seq_lens = torch.arange(1, num_positions + 1).clamp(min=max_position).float()
    bases = base * ((factor * seq_lens / max_position) - (factor - 1)) ** (
        head_dim / (head_dim - 2)
    )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (bases[:, None] ** exponents[None, :])


class RotaryAngles(NamedTuple):
    """One step's rotation: cos and sin [T, 1, head_dim // 2] in the activation dtype.

    The 1 broadcasts over heads, so one lookup serves queries and keys of every layer.
    """

    cos: torch.Tensor
    sin: torch.Tensor


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            supported = ", ".join(SUPPORTED_ROPE_TYPES)
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {supported}")
        self.head_dim = head_dim
        # The leading dimensions of each head that rotate; the rest pass through (Phi-4-mini).
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor gives {rotary_dim} rotary dimensions of {head_dim}"
            )
        self.rotary_dim = rotary_dim
        self.rope_type = rope_type
        self.num_positions = self._num_positions(max_position, params)
        positions = torch.arange(self.num_positions, dtype=torch.float32)
        scaling = 1.0
        if rope_type == "dynamic":
            freqs = positions[:, None] * _dynamic_inv_freq(
                rotary_dim, params, self.num_positions, max_position
            )
        else:
            if rope_type == "default":
                inv_freq = _base_inv_freq(rotary_dim, params["rope_theta"])
            elif rope_type == "linear":
                inv_freq = _base_inv_freq(rotary_dim, params["rope_theta"]) / params["factor"]
            elif rope_type == "llama3":
                inv_freq = _llama3_inv_freq(rotary_dim, params)
            elif rope_type == "longrope":
                inv_freq, scaling = _longrope_inv_freq(rotary_dim, params, max_position)
            else:
                inv_freq, scaling = _yarn_inv_freq(rotary_dim, params)
            freqs = positions[:, None] * inv_freq[None, :]
        # [num_positions, rotary_dim]: cos in the first half, sin in the second.
        cache = torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)
        self.register_buffer("cos_sin_cache", cache.to(torch.float32), persistent=False)

    @classmethod
    def from_config(cls, hf_config: Any, head_dim: int) -> RotaryEmbedding:
        return cls(head_dim, hf_config.max_position_embeddings, rope_parameters_of(hf_config))

    @staticmethod
    def _num_positions(max_position: int, params: dict[str, Any]) -> int:
        # Dynamic NTK and YaRN stretch the context past what config.json names (Qwen2.5 ships
        # max_position_embeddings=32768 with a yarn factor of 4 for 128K).
        if params["rope_type"] == "dynamic":
            return int(max_position * params["factor"])
        if params["rope_type"] == "yarn":
            stretched = int(params["original_max_position_embeddings"] * params["factor"])
            return max(max_position, stretched)
        if params["rope_type"] == "longrope":
            return min(max_position, params["original_max_position_embeddings"])
        return max_position

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rotary_dim // 2] in float32."""
        return self.cos_sin_cache[positions].chunk(2, dim=-1)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryAngles:
        """positions [T] -> the step's angles; cast like HF (cos/sin to the activation dtype)."""
        cos, sin = self.cos_sin(positions)
        return RotaryAngles(cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1))

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, H*D] and k [T, KV*D] (or already [T, heads, D]) by each token's position.

        Returns new tensors; the model itself calls ``rotate_`` on its own buffers instead.
        """
        angles = self.angles(positions, q.dtype)
        rotated = []
        for x in (q, k):
            heads = x.clone(memory_format=torch.contiguous_format).view(
                x.shape[0], -1, self.head_dim
            )
            rotated.append(rotate_(heads, angles).view(x.shape))
        return rotated[0], rotated[1]


def rotate_(x: torch.Tensor, angles: RotaryAngles) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] in place (neox style: the two halves of each head).

    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). In place with one half-size temporary: at
    decode sizes this beat building a new tensor by ~30% (bench_layers); ``x`` may be a strided
    view (a slice of the fused qkv output) as long as each head's values are contiguous. With
    partial rotary the angles cover fewer dimensions than a head: only those rotate, in halves of
    their own, and the rest of the head is left as it is (as transformers does).
    """
    cos, sin = angles
    x1, x2 = x[..., : 2 * cos.shape[-1]].chunk(2, dim=-1)
    x1_sin = x1 * sin
    x1.mul_(cos).addcmul_(x2, sin, value=-1)
    x2.mul_(cos).add_(x1_sin)
    return x


def normalize_and_rotate(
    qk: torch.Tensor, weight: torch.Tensor | None, eps: float, angles: RotaryAngles
) -> torch.Tensor:
    """Queries and keys [T, heads, head_dim] -> each head RMS-normalised times ``weight`` [heads,
    head_dim] (skipped when None), then rotated; the result may be ``qk`` itself, changed in place.

    On CPU in float32 both run as one compiled pass in place (worker/layers/cpu_ops.py: a dozen
    torch ops per layer before); elsewhere the norm gives a fresh tensor that rotates in place.
    """
    ops = load_token_ops() if qk.is_cpu else None
    if ops is not None and TokenOps.takes_heads(qk, weight, *angles):
        return ops.qk_norm_rope_(qk, weight, eps, *angles)
    if use_triton_ops(qk) and qk.stride(-1) == 1 and _triton_takes(qk, weight, angles):
        # One kernel for what took about nine torch ops (worker/layers/triton_ops.py).
        rotated = triton_ops.qk_norm_rope_(qk, weight, eps, *angles)
        if rotated is not None:
            return rotated
    if weight is not None:
        qk = rms_normalize(qk, weight, eps)
    return rotate_(qk, angles)


def _triton_takes(qk: torch.Tensor, weight: torch.Tensor | None, angles: RotaryAngles) -> bool:
    """The kernel's layout: a [heads, head_dim] weight in one block, angles [T, 1, half] whose
    rows are contiguous, all in the activations' dtype (else torch promotes, and so do we)."""
    cos, sin = angles
    if weight is not None and (
        weight.shape != qk.shape[1:] or not weight.is_contiguous() or weight.dtype != qk.dtype
    ):
        return False
    return all(
        a.dim() == 3 and a.shape[1] == 1 and a.stride(-1) == 1 and a.dtype == qk.dtype
        for a in (cos, sin)
    )
