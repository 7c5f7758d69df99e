"""One Triton pass over each token's q and k heads, in place: optional per-head RMSNorm (Qwen3's
q_norm/k_norm) then rotary embedding in the rotate-half layout, and optionally the token's k and
v written into the paged KV cache (a float8 cache with its scales, as fp8.py quantize_fp8
computes them). Replaces six kernels (two norms, two rotations, the cache store) that each read
and wrote q, k or v. rope_store_kv is the same pass over k alone into the cache, nothing written
back: prefill attention norms and rotates q itself."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8_gemm import _quantize_e4m3
from nanovllm.kernels.pdl import pdl_args, pdl_start


@triton.jit
def norm_rope(x1, x2, weight_ptr, cos, sin, eps, HALF: tl.constexpr, NORM: tl.constexpr):
    """Head vectors given as halves x1, x2 [H, HALF] (model dtype) -> the halves after the optional
    RMSNorm (weight [2 * HALF]) and the rotation by cos, sin [1 or H, HALF] (float32)."""
    dtype = x1.dtype
    d = tl.arange(0, HALF)[None, :]
    # Every step is rounded to the model dtype where transformers' bf16/fp16 forward rounds it.
    if NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv_rms = tl.rsqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF) + eps)[:, None]
        x1 = ((f1 * inv_rms).to(dtype) * tl.load(weight_ptr + d)).to(dtype)
        x2 = ((f2 * inv_rms).to(dtype) * tl.load(weight_ptr + HALF + d)).to(dtype)
    cos, sin = cos.to(dtype), sin.to(dtype)
    y1 = ((x1 * cos).to(dtype) - (x2 * sin).to(dtype)).to(dtype)
    y2 = ((x2 * cos).to(dtype) + (x1 * sin).to(dtype)).to(dtype)
    return y1, y2


@triton.jit
def _norm_rope_heads(x_ptr, row, weight_ptr, cos, sin, eps, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                     HALF: tl.constexpr, NORM: tl.constexpr, WRITE: tl.constexpr = True):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = heads < NUM_HEADS
    ptr = x_ptr + row + heads * (2 * HALF) + d
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
    y1, y2 = norm_rope(x1, x2, weight_ptr, cos, sin, eps, HALF, NORM)
    if WRITE:
        tl.store(ptr, y1, mask=mask)
        tl.store(ptr + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def store_heads(cache_ptr, scale_ptr, row, scale_offs, mask, x1, x2, HALF: tl.constexpr, SCALED: tl.constexpr):
    """Write head vectors (halves x1, x2 [H, HALF], the heads where mask [H]) at cache offsets row
    [H, HALF]; with SCALED, as float8 x / scale with scale = max|x| * (1 / 448) per head
    (quantize_fp8's arithmetic), the scales at scale_ptr + scale_offs [H]."""
    if SCALED:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(f1), 1), tl.max(tl.abs(f2), 1))
        scale = tl.maximum(amax, 1e-30) * (1.0 / 448.0)
        x1, x2 = _quantize_e4m3(f1, scale[:, None]), _quantize_e4m3(f2, scale[:, None])
        tl.store(scale_ptr + scale_offs, scale, mask=mask)
    tl.store(cache_ptr + row, x1.to(cache_ptr.dtype.element_ty), mask=mask[:, None])
    tl.store(cache_ptr + row + HALF, x2.to(cache_ptr.dtype.element_ty), mask=mask[:, None])


@triton.jit
def qk_norm_rope_kernel(q_ptr, k_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, stride_q, stride_k, eps,
                        v_ptr, stride_v, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
                        NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, Q_PAD: tl.constexpr,
                        K_PAD: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr, STORE: tl.constexpr,
                        SCALED: tl.constexpr, IN_PLACE: tl.constexpr, PDL: tl.constexpr):
    """Grid (num_tokens,): one token's q and k heads normed and rotated in place. With STORE, also
    k (rotated) and v into the caches at the token's slot (slot_mapping; -1 skips): the cache row of
    a slot is its num_kv_heads * head_dim values, its scales (SCALED) num_kv_heads floats. Not
    IN_PLACE: q untouched, k only stored."""
    pdl_start(PDL)
    t = tl.program_id(0)
    pos = tl.load(positions_ptr + t)
    d = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + d)
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + d)
    if IN_PLACE:
        _norm_rope_heads(q_ptr, t.to(tl.int64) * stride_q, q_weight_ptr, cos, sin, eps, NUM_Q_HEADS, Q_PAD, HALF,
                         NORM)
    k1, k2 = _norm_rope_heads(k_ptr, t.to(tl.int64) * stride_k, k_weight_ptr, cos, sin, eps, NUM_K_HEADS, K_PAD,
                              HALF, NORM, IN_PLACE)
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            heads = tl.arange(0, K_PAD)
            head_mask = heads < NUM_K_HEADS
            row = slot * (NUM_K_HEADS * 2 * HALF) + heads[:, None] * (2 * HALF) + d
            scale_offs = slot * NUM_K_HEADS + heads
            store_heads(k_cache_ptr, k_scale_ptr, row, scale_offs, head_mask, k1, k2, HALF, SCALED)
            v_row = v_ptr + t.to(tl.int64) * stride_v + heads[:, None] * (2 * HALF) + d
            v1 = tl.load(v_row, mask=head_mask[:, None])
            v2 = tl.load(v_row + HALF, mask=head_mask[:, None])
            store_heads(v_cache_ptr, v_scale_ptr, row, scale_offs, head_mask, v1, v2, HALF, SCALED)


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                 kv_cache: tuple | None = None):
    """In place on q: [T, num_heads, head_dim] and k: [T, num_kv_heads, head_dim] (heads contiguous,
    tokens may be strided, e.g. views of the packed qkv); positions [T] int64; cos_sin_cache
    [max_position, head_dim] float32 (cos | sin). Norm weights [head_dim], both or neither.
    kv_cache: None, or (v [T, num_kv_heads, head_dim], k_cache, v_cache, k_scales, v_scales,
    slot_mapping [T]) to also write the rotated k and v into the caches [num_blocks, block_size,
    num_kv_heads, head_dim]; the scales [num_blocks, block_size, num_kv_heads] float32 of float8
    caches, else None."""
    _launch(positions, q, k, cos_sin_cache, q_weight, k_weight, eps, kv_cache, in_place=True)
    return q, k


def rope_store_kv(positions: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, k_weight: torch.Tensor | None,
                  eps: float, kv_cache: tuple):
    """qk_norm_rope's store of the normed, rotated k and of v into the cache (kv_cache as there), with
    k itself left as it is and no q: for attention kernels that norm and rotate q themselves."""
    _launch(positions, k, k, cos_sin_cache, k_weight, k_weight, eps, kv_cache, in_place=False)


def _launch(positions, q, k, cos_sin_cache, q_weight, k_weight, eps, kv_cache, in_place):
    assert q.stride(2) == k.stride(2) == 1 and q.stride(1) == k.stride(1) == q.size(2)
    norm, store = k_weight is not None, kv_cache is not None
    v, k_cache, v_cache, k_scales, v_scales, slots = kv_cache if store else (k, k, k, None, None, positions)
    scaled = k_scales is not None
    assert not store or (v.stride(2) == 1 and v.stride(1) == v.size(2) and k_cache.is_contiguous()
                         and v_cache.is_contiguous() and k_cache.shape[2:] == k.shape[1:])
    assert not scaled or (k_scales.is_contiguous() and v_scales.is_contiguous())
    qk_norm_rope_kernel[(k.size(0),)](
        q, k, positions, cos_sin_cache, q_weight if norm else q, k_weight if norm else k, q.stride(0), k.stride(0), eps,
        v, v.stride(0), k_cache, v_cache, k_scales if scaled else k, v_scales if scaled else k, slots,
        NUM_Q_HEADS=q.size(1), NUM_K_HEADS=k.size(1), Q_PAD=triton.next_power_of_2(q.size(1)),
        K_PAD=triton.next_power_of_2(k.size(1)), HALF=k.size(2) // 2, NORM=norm, STORE=store, SCALED=scaled,
        IN_PLACE=in_place, num_warps=4, **pdl_args(k.device))
