import torch
from torch import nn

from nanovllm.kernels.compile import token_compile
from nanovllm.kernels.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """rms_norm as a module, compiled (token_compile): forward(x) -> y, or forward(x, residual) ->
    (y, x + residual): the residual add is fused into the norm so the sum is read once."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    @token_compile
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        y, r = rms_norm(x, residual, self.weight, self.eps)
        return y if residual is None else (y, r)


def residual_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                  group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's input: (norm(r), r) for r = x + residual (r = x when residual is None);
    x, residual: [num_tokens, hidden_size]. With a tensor-parallel group (a TPGroup, tensor
    parallelism) x is this rank's partial sums, summed over the ranks with the add and the norm
    (TPGroup.all_reduce_rms_norm)."""
    if group is not None:
        return group.all_reduce_rms_norm(x, residual, norm)
    return (norm(x), x) if residual is None else norm(x, residual)
