"""The token embedding, its rows split across tensor-parallel ranks (vocab-parallel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.core.parallel import TensorParallel
from kestrel.layers.linear import ShardSlice, copy_into


def vocab_rows(vocab_size: int, parallel: TensorParallel) -> ShardSlice:
    """This rank's block of the vocabulary; the last block is padded when the split is uneven."""
    part = -(-vocab_size // parallel.size)
    return ShardSlice(parallel.rank * part, part, vocab_size)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: TensorParallel) -> None:
        super().__init__()
        self.parallel = parallel
        self.rows = vocab_rows(vocab_size, parallel)
        self.weight = nn.Parameter(torch.empty(self.rows.size, hidden_size), requires_grad=False)

    def shard_ids(self) -> frozenset[str | None]:
        return frozenset({None})

    def load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard_id: str | None) -> None:
        copy_into(param.data, self.rows.take(tensor, 0, "embedding rows"), "embedding rows")

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.size == 1:
            return F.embedding(token_ids, self.weight)
        # Each rank looks up the ids in its block (zeros elsewhere); the sum is the embedding.
        local = token_ids - self.rows.start
        inside = (local >= 0) & (local < self.rows.size)
        out = F.embedding(local.clamp(0, self.rows.size - 1), self.weight) * inside[:, None]
        return self.parallel.all_reduce(out)
