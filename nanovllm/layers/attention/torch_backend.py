"""Reference attention backend in plain torch: correct on any device, slow (a Python loop over sequences)."""
import torch
import torch.nn.functional as F

from nanovllm.layers.attention.base import AttentionBackend, AttentionMetadata


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                              scale: float, k_scales: torch.Tensor | None = None,
                              v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the new tokens q: [T, num_heads, head_dim] over each sequence's keys in
    the paged caches [num_blocks, block_size, num_kv_heads, head_dim] (meta.block_tables,
    meta.context_lens, meta.cu_seqlens_q), dequantized by k_scales, v_scales [num_blocks,
    block_size, num_kv_heads] when given (a float8 cache); softmax in float32. Returns [T, num_heads, head_dim]."""
    out = torch.empty_like(q)
    block_size = k_cache.size(1)
    cu_q = meta.cu_seqlens_q.tolist()

    def gather(cache, scales, blocks, ctx_len):  # [L, num_kv_heads, head_dim] float32
        x = cache[blocks].flatten(0, 1)[:ctx_len].float()
        return x if scales is None else x * scales[blocks].flatten(0, 1)[:ctx_len].unsqueeze(-1)

    for i, ctx_len in enumerate(meta.context_lens.tolist()):
        q_start, q_end = cu_q[i], cu_q[i + 1]
        n = q_end - q_start
        blocks = meta.block_tables[i, :(ctx_len + block_size - 1) // block_size].long()
        k, v = gather(k_cache, k_scales, blocks, ctx_len), gather(v_cache, v_scales, blocks, ctx_len)
        group = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        q_pos = torch.arange(ctx_len - n, ctx_len, device=q.device)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]  # [n, L]
        o = F.scaled_dot_product_attention(q[q_start:q_end].float().transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), attn_mask=mask, scale=scale)
        out[q_start:q_end] = o.transpose(0, 1).to(q.dtype)
    return out


class TorchBackend(AttentionBackend):
    name = "torch"
    supports_cuda_graphs = False  # attend reads sequence lengths on the host

    def attend(self, layer_idx, q, meta, scale):
        i = layer_idx
        return paged_attention_reference(q, self.k_caches[i], self.v_caches[i], meta, scale, self.k_scales[i],
                                         self.v_scales[i])
