import torch


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019) as in Llama/Qwen, with the residual add before it:
    (r / sqrt(mean(r^2) + eps) * weight, r) for r = x + residual (summed in the model dtype, as
    transformers does), or r = x; the norm computed in float32, rounded, then times weight.
    x, residual: [num_tokens, hidden_size]; weight: [hidden_size]. Eager: RMSNorm compiles it."""
    r = x if residual is None else x + residual
    rf = r.float()
    return (rf * torch.rsqrt(rf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype) * weight, r
