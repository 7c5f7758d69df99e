import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.parallel.state import TensorParallel


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose vocabulary rows are split evenly across tensor-parallel ranks.

    forward(input_ids [T] int64) -> [T, embedding_dim]; rows owned by other ranks are zero
    here and summed in by the all-reduce.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel):
        super().__init__()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.num_embeddings = num_embeddings
        self.shard = (num_embeddings + self.tp_size - 1) // self.tp_size
        self.vocab_start = self.shard * self.tp_rank
        self.weight = nn.Parameter(torch.empty(self.shard, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        if loaded.shape[1:] != param.shape[1:] or loaded.size(0) != self.num_embeddings:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, "
                             f"expected ({self.num_embeddings}, {param.size(1)})")
        rows = loaded[self.vocab_start:self.vocab_start + self.shard]
        param.data[:rows.size(0)].copy_(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(x, self.weight)
        local = x - self.vocab_start
        mask = (local >= 0) & (local < self.shard)
        y = F.embedding(local.clamp(0, self.shard - 1), self.weight) * mask.unsqueeze(1)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; each rank computes its slice of the logits and
    rank 0 gathers them. forward(hidden [N, hidden_size]) -> logits [N, vocab_size] (rank 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        logits = F.linear(x, self.weight)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, 0)
        return torch.cat(parts, -1)[:, :self.num_embeddings] if self.tp_rank == 0 else None
