import torch
from torch import nn

from nanovllm.layers.token_compile import token_compile


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019) as in Llama/Qwen, with the residual add before it:
    (r / sqrt(mean(r^2) + eps) * weight, r) for r = x + residual (summed in the model dtype, as
    transformers does), or r = x; the norm computed in float32, rounded, then times weight.
    x, residual: [num_tokens, hidden_size]; weight: [hidden_size]. Eager: RMSNorm compiles it."""
    r = x if residual is None else x + residual
    rf = r.float()
    return (rf * torch.rsqrt(rf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype) * weight, r


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
