"""Reference attention backend in plain torch: correct on any device, slow (a Python loop over sequences)."""
import torch
import torch.nn.functional as F

from nanovllm.utils.context import Context


class TorchBackend:
    name = "torch"
    supports_cuda_graphs = False  # forward reads sequence lengths on the host
    fused_kv_store = False

    @staticmethod
    def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor):
        """Scatter k, v: [T, num_kv_heads, head_dim] into the caches
        [num_blocks, block_size, num_kv_heads, head_dim] at the flat slots slot_mapping [T]; slot -1 is skipped."""
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        k_cache.view(-1, *k.shape[1:])[slots] = k[keep].to(k_cache.dtype)
        v_cache.view(-1, *v.shape[1:])[slots] = v[keep].to(v_cache.dtype)

    @staticmethod
    def forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context, scale: float) -> torch.Tensor:
        """Causal attention of the new tokens q: [T, num_heads, head_dim] over each sequence's keys in
        the paged cache (ctx.block_tables, ctx.context_lens); a query at index i of a run of n new tokens
        sits at position context_len - n + i. Softmax in float32. Returns [T, num_heads, head_dim]."""
        out = torch.empty_like(q)
        block_size = k_cache.size(1)
        cu_q = ctx.cu_seqlens_q.tolist()
        lens = ctx.context_lens.tolist()
        for i, ctx_len in enumerate(lens):
            q_start, q_end = cu_q[i], cu_q[i + 1]
            n = q_end - q_start
            blocks = ctx.block_tables[i, :(ctx_len + block_size - 1) // block_size].long()
            k = k_cache[blocks].flatten(0, 1)[:ctx_len].float()  # [L, num_kv_heads, head_dim]
            v = v_cache[blocks].flatten(0, 1)[:ctx_len].float()
            qi = q[q_start:q_end].float()
            group = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            q_pos = torch.arange(ctx_len - n, ctx_len, device=q.device)
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]  # [n, L]
            o = F.scaled_dot_product_attention(qi.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               attn_mask=mask, scale=scale)
            out[q_start:q_end] = o.transpose(0, 1).to(q.dtype)
        return out
