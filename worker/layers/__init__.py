"""The model building blocks, written so tensor parallelism can shard them.

Runs in worker processes.
"""

from conveyor.worker.layers.activation import GeluAndMul, SiluAndMul
from conveyor.worker.layers.attention import Attention
from conveyor.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from conveyor.worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from conveyor.worker.layers.norm import GemmaRMSNorm, RMSNorm, gemma_rms_normalize, rms_normalize
from conveyor.worker.layers.rotary import (
    RotaryAngles,
    RotaryEmbedding,
    normalize_and_rotate,
    rope_parameters_of,
    rotate_,
)

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "GeluAndMul",
    "GemmaRMSNorm",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryAngles",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "default_weight_loader",
    "gemma_rms_normalize",
    "normalize_and_rotate",
    "rms_normalize",
    "rope_parameters_of",
    "rotate_",
]
