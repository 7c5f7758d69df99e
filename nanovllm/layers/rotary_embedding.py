import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021, RoFormer) in the "rotate half" (GPT-NeoX) layout
    that Llama, Qwen2 and Qwen3 checkpoints use.

    Inverse frequencies come from the config: theta^(-2i/d) by default, and transformers'
    ROPE_INIT_FUNCTIONS for scaled variants (llama3, linear, yarn, ...). cos/sin are cached
    for positions [0, max_position) in float32 and rounded to the model dtype when applied.
    forward(positions [T] int64, q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim]) -> (q, k).
    """

    def __init__(self, config, head_dim: int, max_position: int):
        super().__init__()
        params = _rope_parameters(config)
        rope_type = params["rope_type"]
        if rope_type == "default":
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS and rope_type != "dynamic":
            with torch.device("cpu"):  # transformers makes some of them on the default device (meta: no data)
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
            inv_freq = inv_freq.to(torch.get_default_device())
        else:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: default, "
                             f"{', '.join(k for k in ROPE_INIT_FUNCTIONS if k != 'dynamic')}")
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq.float())
        # [max_position, head_dim]: cos in the first half, sin in the second
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], -1) * scaling, persistent=False)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, norms=None):
        """q, k: [T, heads, head_dim]; norms: None or the (q_norm, k_norm) RMSNorms applied per head
        first. Rounds cos/sin to the model dtype and rotates in it, as transformers does."""
        if norms:
            q, k = norms[0](q), norms[1](k)
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).to(q.dtype).chunk(2, -1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
