"""Hopper prefill attention in Gluon: a persistent, warp-specialised kernel for a packed step's q
tiles and decoding sequences, with q normed and rotated inside (the Triton kernel's new_q).

The shape of cuDNN's sm90 flash-attention kernel (a CTA per SM, a producer warpgroup and two
consumer warpgroups of 64 query rows, 128-wide K/V tiles): the producer takes work items by an
atomic counter (so no static order leaves SMs idle), passes each item's record to the consumers in
shared memory with Q's mbarrier, and streams Q and K/V through TMA into double buffers while the
consumers run QK^T and P @ V as wgmma; a full q tile's output leaves by TMA from its Q buffer. A
decoding sequence's item takes all GROUP query heads of one KV head as rows and the two consumers
split its K/V tiles, so decode reads overlap the q tiles' compute across the SMs (POD-Attention's
point, Kamath et al., ASPLOS 2025) without a second kernel.
H100, q normed and rotated inside, a step of 16,384 tokens: prompts of 1000-2000 tokens after D
decoding sequences (contexts 1000-2000), us (the Triton kernel -> this design):
Qwen3-0.6B's heads (16 on 8) D = 0 296 -> 251, 64 406 -> 361, 200 624 -> 597; Qwen3-8B's (32 on
8) 591 -> 491, 704 -> 614, 919 -> 839. bench.py prefill-heavy: 1.25 -> 1.22 s, medians
(docs/perf-log.md, 2026-11-27).
Only for Hopper, q in bf16 or fp16, head_dim 128, an even number of query heads per KV head, and
a model-dtype cache whose blocks hold whole 128-token tiles; TritonBackend takes the Triton kernel
otherwise."""
import numpy as np
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from nanovllm.kernels.gluon_prefill_roles import _consumer, _producer
from nanovllm.kernels.pdl import num_sms
from nanovllm.kernels.attention import LOG2E

BLOCK_M, BLOCK_N, HEAD_DIM, STAGES = 64, 128, 128, 2


def work_list(q_lens: np.ndarray) -> np.ndarray:
    """A prefill step's work entries [n, 2] int32 (sequence, q tile) for sequences with q_lens new
    tokens each: every sequence with several new tokens gives its BLOCK_M-row q tiles from the last
    (the most keys) down; a decoding one (one new token) gives (sequence, -1), spread evenly among
    the others so that the SMs mix decode reads with q tiles' compute."""
    dec = [(s, -1) for s in np.flatnonzero(q_lens == 1)]
    pre = [(s, m) for s in np.flatnonzero(q_lens > 1) for m in range(-(-int(q_lens[s]) // BLOCK_M) - 1, -1, -1)]
    out, d = [], 0
    for k, e in enumerate(pre):
        while d < len(dec) and d * len(pre) <= k * len(dec):
            out.append(dec[d])
            d += 1
        out.append(e)
    return np.array(out + dec[d:], dtype=np.int32).reshape(-1, 2)


@gluon.jit(do_not_specialize=["n_items", "stride_bt"])  # they vary by step: no recompiles
def persistent_prefill_kernel(q_desc, k_desc, v_desc, o_desc, counter_ptr, entries_ptr, n_items, q_ptr, stride_qt,
                              stride_qh, o_ptr, stride_ot, stride_oh, cu_q_ptr, context_lens_ptr, block_tables_ptr,
                              stride_bt, qk_scale, cos_sin_ptr, q_weight_ptr, eps, SLOTS: gl.constexpr,
                              GROUP: gl.constexpr, BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr, NORM: gl.constexpr):
    """Persistent grid (one CTA per SM) of three warpgroups: _producer and two _consumer. Shared
    memory at Qwen3's head_dim 128, bf16: Q 2 x 2 x 16 KB, K/V STAGES x 2 x 32 KB, the decode merge's
    32.5 KB: 225 KB of the H100's 227."""
    TOK: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, 2 * TOK, HEAD_DIM], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    recs = gl.allocate_shared_memory(gl.int32, [2, 8], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    xchg = gl.allocate_shared_memory(gl.float32, [TOK, HEAD_DIM], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    xml = gl.allocate_shared_memory(gl.float32, [2, TOK], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    m_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    m_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(m_ready, count=1)
    mbarrier.init(m_empty, count=1)
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    descs = (q_desc, k_desc, v_desc, o_desc)
    bufs = (q_bufs, k_bufs, v_bufs, xchg, xml)
    bars = (q_ready, q_empty, k_ready, v_ready, kv_empty, m_ready, m_empty)
    cons = (descs, bufs, bars, recs, q_ptr, stride_qt, stride_qh, o_ptr, stride_ot, stride_oh, qk_scale, cos_sin_ptr,
            q_weight_ptr, eps, NORM, GROUP)
    gl.warp_specialize([
        (_producer, ((q_desc, k_desc, v_desc), (q_bufs, k_bufs, v_bufs),
                     (q_ready, q_empty, k_ready, v_ready, kv_empty), recs, counter_ptr, entries_ptr, n_items, cu_q_ptr,
                     context_lens_ptr, block_tables_ptr, stride_bt, SLOTS, GROUP, BLOCK_SIZE)),
        (_consumer, (0, ) + cons),
        (_consumer, (1, ) + cons),
    ], [4, 4], [240, 240])



def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, entries, scale, new_q,
                      out=None):
    """Causal attention of a packed step's new tokens q: [T, num_heads, head_dim] (this step's
    projections: new_q = (cos_sin_cache [max_position, head_dim] float32, q_norm weight [head_dim]
    or None, eps) norms and rotates them inside; rows may be strided) over the paged caches
    [num_blocks, block_size, num_kv_heads, head_dim] (q's dtype), as triton_backend's
    prefill_attention; entries: work_list of the step on the device. Returns out [T, num_heads,
    head_dim] (contiguous)."""
    T, H, D = q.shape
    num_kv_heads = k_cache.size(2)
    assert D == HEAD_DIM and H % num_kv_heads == 0 and (H // num_kv_heads) % 2 == 0
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.size(1) % BLOCK_N == 0
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device) if out is None else out
    dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
    q_desc = TensorDescriptor.from_tensor(q.view(T, H * D), [BLOCK_M, D], q_layout)
    o_desc = TensorDescriptor.from_tensor(out.view(T, H * D), [BLOCK_M, D], q_layout)
    k_desc, v_desc = (TensorDescriptor.from_tensor(c.view(-1, num_kv_heads * D), [BLOCK_N, D], kv_layout)
                      for c in (k_cache, v_cache))
    n_items = entries.size(0) * (H // 2)
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)  # the items taken so far
    cos_sin, q_weight, eps = new_q
    persistent_prefill_kernel[(max(1, min(num_sms(q.device.index), n_items)),)](
        q_desc, k_desc, v_desc, o_desc, counter, entries, n_items, q, q.stride(0), q.stride(1), out, out.stride(0),
        out.stride(1), cu_seqlens_q, context_lens, block_tables, block_tables.stride(0), scale * LOG2E, cos_sin,
        q if q_weight is None else q_weight, eps, SLOTS=H // 2, GROUP=H // num_kv_heads, BLOCK_SIZE=k_cache.size(1),
        STAGES=STAGES, NORM=q_weight is not None, num_warps=4, maxnreg=168)
    return out
