"""One Triton pass over each token's q and k heads, in place: optional per-head RMSNorm (Qwen3's
q_norm/k_norm) then rotary embedding in the rotate-half layout. Replaces four elementwise kernels
(two norms, two rotations) that each read and wrote q or k."""
import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_heads(x_ptr, row, weight_ptr, cos, sin, eps, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                     HALF: tl.constexpr, NORM: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = heads < NUM_HEADS
    ptr = x_ptr + row + heads * (2 * HALF) + d
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
    # Every step is rounded to the model dtype where transformers' bf16/fp16 forward rounds it.
    if NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv_rms = tl.rsqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF) + eps)[:, None]
        x1 = ((f1 * inv_rms).to(dtype) * tl.load(weight_ptr + d)).to(dtype)
        x2 = ((f2 * inv_rms).to(dtype) * tl.load(weight_ptr + HALF + d)).to(dtype)
    cos, sin = cos.to(dtype), sin.to(dtype)
    tl.store(ptr, ((x1 * cos).to(dtype) - (x2 * sin).to(dtype)).to(dtype), mask=mask)
    tl.store(ptr + HALF, ((x2 * cos).to(dtype) + (x1 * sin).to(dtype)).to(dtype), mask=mask)


@triton.jit
def qk_norm_rope_kernel(q_ptr, k_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, stride_q, stride_k, eps,
                        NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, Q_PAD: tl.constexpr,
                        K_PAD: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    """Grid (num_tokens,)."""
    t = tl.program_id(0)
    pos = tl.load(positions_ptr + t)
    d = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + d)
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + d)
    _norm_rope_heads(q_ptr, t.to(tl.int64) * stride_q, q_weight_ptr, cos, sin, eps, NUM_Q_HEADS, Q_PAD, HALF, NORM)
    _norm_rope_heads(k_ptr, t.to(tl.int64) * stride_k, k_weight_ptr, cos, sin, eps, NUM_K_HEADS, K_PAD, HALF, NORM)


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6):
    """In place on q: [T, num_heads, head_dim] and k: [T, num_kv_heads, head_dim] (heads contiguous,
    tokens may be strided, e.g. views of the packed qkv); positions [T] int64; cos_sin_cache
    [max_position, head_dim] float32 (cos | sin). Norm weights [head_dim], both or neither."""
    assert q.stride(2) == k.stride(2) == 1 and q.stride(1) == k.stride(1) == q.size(2)
    norm = q_weight is not None
    qk_norm_rope_kernel[(q.size(0),)](
        q, k, positions, cos_sin_cache, q_weight if norm else q, k_weight if norm else k, q.stride(0), k.stride(0), eps,
        NUM_Q_HEADS=q.size(1), NUM_K_HEADS=k.size(1), Q_PAD=triton.next_power_of_2(q.size(1)),
        K_PAD=triton.next_power_of_2(k.size(1)), HALF=q.size(2) // 2, NORM=norm, num_warps=4)
    return q, k
