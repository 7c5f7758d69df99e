"""Paged attention behind one narrow interface.

A backend has `forward(q, k_cache, v_cache, ctx, scale) -> o` and either
`store_kvcache(k, v, k_cache, v_cache, slot_mapping)` or `fused_kv_store = True`, when the
q/k-norm + rope kernel writes K/V into the cache instead (one kernel fewer per layer). Keys and
values are always read back from the paged cache [num_blocks, block_size, num_kv_heads,
head_dim], so prefix-cache hits, chunked prefill and decode are one code path.
"""
import importlib.util

import torch
from torch import nn

from nanovllm.layers.attention.torch_backend import TorchBackend
from nanovllm.utils.context import get_context

BACKENDS = ("auto", "triton", "torch")


def select_backend(name: str, device: torch.device, head_dim: int):
    """Return the backend class for `name`; "auto" picks Triton on CUDA (when triton imports and
    head_dim is a power of two >= 16) and torch otherwise. "triton" on CPU needs TRITON_INTERPRET=1.
    Raises ValueError for an unknown or unusable backend."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    has_triton = importlib.util.find_spec("triton") is not None
    auto = name == "auto"
    if auto:
        name = "triton" if device.type == "cuda" and has_triton else "torch"
    if name == "triton":
        if not has_triton:
            raise ValueError("attention_backend='triton' needs the triton package")
        from nanovllm.layers.attention.triton_backend import TritonBackend
        if TritonBackend.supports(head_dim):
            return TritonBackend
        if not auto:
            raise ValueError(f"the triton backend needs head_dim a power of two >= 16, got {head_dim}")
    return TorchBackend


class Attention(nn.Module):
    """Causal attention over the paged KV cache for q: [T, num_heads * head_dim],
    k, v: [T, num_kv_heads * head_dim]; returns [T, num_heads * head_dim].
    The ModelRunner sets `k_cache`, `v_cache` and `backend` before the first step."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend = TorchBackend

    def fused_store_args(self, v: torch.Tensor):
        """The kv_cache argument of RotaryEmbedding.forward: (v, k_cache, v_cache, slot_mapping)
        when the backend leaves the K/V store to the rope kernel, else None."""
        if not self.backend.fused_kv_store:
            return None
        return v.view(-1, self.num_kv_heads, self.head_dim), self.k_cache, self.v_cache, get_context().slot_mapping

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v are written into the cache here unless the rope kernel already did (fused_store_args)."""
        ctx = get_context()
        q = q.view(-1, self.num_heads, self.head_dim)
        if not self.backend.fused_kv_store:
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        o = self.backend.forward(q, self.k_cache, self.v_cache, ctx, self.scale)
        return o.view(-1, self.num_heads * self.head_dim)
