"""The compute roofline of a batch: the FLOPs a dense decoder must do, against a matmul calibration.

Runs in the benchmark's own process, from the model's Hugging Face config.json alone (no weights,
no torch). A batch's FLOPs are what any engine has to compute for it, whatever its kernels:

* every token that goes through the model (the prompt, and each output token but the last, which
  is never fed back) costs 2 FLOPs per weight of the layers' linears (q, k, v, o, gate, up, down);
* attention costs 4 * query heads * head_dim FLOPs per layer per (query, key) pair it attends to
  (scores and the weighted sum), causal: the token at position i attends to i + 1 keys;
* the LM head runs only on the rows that are sampled, one per output token.

Divided by the wall time and by the same run's matmul calibration (GFLOP/s of a large float32
GEMM on this machine), it is the share of the machine's matmul speed the engine turned into
model work. Embedding lookups, norms, RoPE and activations are left out: they are memory-bound
and small against the matmuls for these shapes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DenseShapes:
    """The numbers of a dense decoder that decide its FLOPs."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> DenseShapes:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        num_heads = config["num_attention_heads"]
        return cls(
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads", num_heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
        )

    def linear_flops_per_token(self) -> int:
        qkv = self.hidden_size * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        out = self.num_heads * self.head_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return 2 * self.num_layers * (qkv + out + mlp)

    def attention_flops_per_pair(self) -> int:
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def lm_head_flops_per_row(self) -> int:
        return 2 * self.hidden_size * self.vocab_size


def batch_flops(shapes: DenseShapes, prompt_lens: Sequence[int], output_lens: Sequence[int]) -> int:
    """FLOPs to serve requests of these prompt and output lengths (see the module docstring)."""
    total = 0
    for prompt_len, output_len in zip(prompt_lens, output_lens, strict=True):
        fed = prompt_len + max(output_len - 1, 0)
        pairs = fed * (fed + 1) // 2
        total += fed * shapes.linear_flops_per_token()
        total += pairs * shapes.attention_flops_per_pair()
        total += output_len * shapes.lm_head_flops_per_row()
    return total


def roofline_share(flops: int, seconds: float, calibration_gflops: float) -> float:
    """Achieved model GFLOP/s as a share of the calibration (1.0 = at the matmul speed)."""
    return flops / seconds / 1e9 / calibration_gflops
