"""Token embedding and LM head, split over the vocabulary for tensor parallelism.

Runs in worker processes. Each rank holds a contiguous range of vocabulary rows (the last range
padded so every rank has the same shape). The embedding looks up the ids in its range, zeroes the
rest and all-reduces; the LM head computes logits for its range and all-gathers them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.worker.layers.gemm import linear, pack_weight
from conveyor.worker.layers.linear import ShardId
from conveyor.worker.layers.parallel import all_gather_last_dim, all_reduce


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.num_embeddings_per_rank = -(-num_embeddings // tp_size)  # ceil
        self.vocab_start = tp_rank * self.num_embeddings_per_rank
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_rank, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_rank, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"vocabulary mismatch: model has {self.num_embeddings} rows, checkpoint "
                f"{loaded_weight.shape[0]}"
            )
        num_rows = self.vocab_end - self.vocab_start
        param.data[:num_rows].copy_(loaded_weight[self.vocab_start : self.vocab_end])
        param.data[num_rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        embeddings = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return self.all_reduce(embeddings)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return all_reduce(partial, self.tp_size)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [R, hidden] -> logits [R, vocab]; may share its weight with the embedding.

    The head is the biggest matmul of a decode step, so it gets the packed small-batch copy too
    (see gemm.py); with a tied weight that copy is the one extra table, the embedding is not.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_rank, tp_size)
        self.packed_weight: torch.Tensor | None = None
        # ``--quantization int4``'s 4-bit or ``int8``'s int8 copy of the head (an Int4Panels or
        # an Int8Weight: ``linear(hidden)``), which the logits read in place of the float
        # weight; the embedding (if tied) keeps the float one.
        self.quantized = None

    def process_weights_after_loading(self) -> None:
        if self.quantized is None:
            self.packed_weight = pack_weight(self.weight)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        self.packed_weight = None  # stale once the weight changes; rebuilt after loading
        super().weight_loader(param, loaded_weight, shard_id)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.quantized is not None:
            logits = self.all_gather(self.quantized.linear(hidden))
        else:
            logits = self.all_gather(linear(hidden, self.weight, None, self.packed_weight))
        # Drop the padding rows of the last rank's range.
        return logits[..., : self.num_embeddings]

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(shard, self.tp_size)
