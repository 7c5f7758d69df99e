import torch
from torch import nn

from nanovllm.layers.token_compile import token_compile


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) as in Llama/Qwen: x / sqrt(mean(x^2) + eps) * weight, computed in float32.

    forward(x) -> y, or forward(x, residual) -> (y, x + residual): the residual add is fused
    into the norm so the sum is read once. x, residual: [num_tokens, hidden_size].
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        var = x.pow(2).mean(dim=-1, keepdim=True)
        return (x * torch.rsqrt(var + self.eps)).to(dtype) * self.weight

    @token_compile
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        dtype = x.dtype
        if residual is None:
            return self._norm(x.float(), dtype)
        residual = x + residual  # summed in the model dtype, as transformers does
        return self._norm(residual.float(), dtype), residual
