"""The model building blocks, written so tensor parallelism can shard them.

Runs in worker processes.
"""

from worker.layers.activation import SiluAndMul
from worker.layers.attention import Attention
from worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from worker.layers.norm import RMSNorm, rms_normalize
from worker.layers.rotary import RotaryAngles, RotaryEmbedding, rope_parameters_of, rotate_

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryAngles",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "default_weight_loader",
    "rms_normalize",
    "rope_parameters_of",
    "rotate_",
]
