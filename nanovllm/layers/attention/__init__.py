"""Paged attention: the Attention layer of every decoder block and the backends behind it
(base.py says what a backend is; torch_backend.py is the reference, triton_backend.py the fast path)."""
import importlib

import torch
from torch import nn

from nanovllm.layers.attention.base import AttentionBackend, AttentionMetadata
from nanovllm.layers.rotary_embedding import RotaryEmbedding


BACKENDS = {"triton": "nanovllm.layers.attention.triton_backend:TritonBackend",
            "torch": "nanovllm.layers.attention.torch_backend:TorchBackend"}  # attention_backend name -> class


def make_backend(name: str) -> AttentionBackend:
    """A new backend by its (resolved) attention_backend name, a key of BACKENDS; imported only
    when used (the Triton one needs triton)."""
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


class Attention(nn.Module):
    """Causal attention over the paged KV cache of layer `layer_idx`: q: [T, num_heads * head_dim],
    k, v: [T, num_kv_heads * head_dim] before the rotary embedding -> [T, num_heads * head_dim].

    qk_norms: None, or the (q_norm, k_norm) RMSNorms that Qwen3 applies per head before the
    rotation; they belong to the caller (their weights are named after it in checkpoints) and are
    held here unregistered. The backend decides how the rotation, the K/V store and the attention
    run (the Triton backend fuses the first two)."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, layer_idx: int, rotary_emb: RotaryEmbedding,
                 qk_norms: tuple[nn.Module, nn.Module] | None, backend: AttentionBackend | None):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.layer_idx, self.scale = layer_idx, head_dim ** -0.5
        self.rotary_emb = rotary_emb
        self.qk_norms = qk_norms
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.backend.forward(self, q, k, v, meta).view(-1, self.num_heads * self.head_dim)
