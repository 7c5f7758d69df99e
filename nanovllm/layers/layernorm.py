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
