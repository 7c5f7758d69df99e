import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.process_group import EMBEDDING_SLOT
from nanovllm.layers.linear_method import one_row
from nanovllm.distributed.state import TensorParallel


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose vocabulary rows are split evenly across tensor-parallel ranks.

    forward(input_ids [T] int64) -> [T, embedding_dim]. With tp_size > 1 that is this rank's partial
    sum: the rows of tokens other ranks own are zero here, and the first norm sums the ranks'
    (all_reduce_rms_norm), written into the buffer partial_sums_buffer gives where it has room.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel):
        super().__init__()
        self.tp_rank, self.tp_size, self.group = tp.rank, tp.size, tp.group
        self.num_embeddings = num_embeddings
        self.shard = (num_embeddings + self.tp_size - 1) // self.tp_size
        self.vocab_start = self.shard * self.tp_rank
        self.num_real = max(0, min(self.shard, num_embeddings - self.vocab_start))  # the rest of the shard pads
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
        out = self.group.partial_sums_buffer(x.size(0), self.weight.dtype, EMBEDDING_SLOT)
        y = F.embedding(local.clamp(0, self.shard - 1), self.weight)
        return torch.mul(y, mask.unsqueeze(1), out=out) if out is not None else y * mask.unsqueeze(1)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary. forward(hidden [N, hidden_size]) -> this rank's slice of
    the logits [N, vocab_size / tp_size] (written to out when given: a decode graph's static buffer);
    gather(that slice) -> the logits [N, vocab_size] on rank 0, None on the others."""

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if one_row(x):  # a decode step of one sequence: the GEMV kernel, not cuBLAS's tensor-core tiles
            from nanovllm.kernels.gemv import gemv
            return gemv(x, self.weight, out=out)
        return F.linear(x, self.weight) if out is None else torch.matmul(x, self.weight.t(), out=out)

    @property
    def logits_width(self) -> int:
        """Columns of forward's logits: this rank's slice of the vocabulary."""
        return self.weight.size(0)

    def gather(self, logits: torch.Tensor) -> torch.Tensor | None:
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits.contiguous(), parts, 0)
        return torch.cat(parts, -1)[:, :self.num_embeddings] if self.tp_rank == 0 else None
