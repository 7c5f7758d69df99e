"""Paged-attention kernels in Triton.

Cache layout (as flash-attn's paged KV): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim];
a sequence's token t lives in block block_table[t // block_size] at offset t % block_size. Tiles of
BLOCK_N keys start at multiples of BLOCK_N, so where BLOCK_N divides block_size a tile lies in one
block and takes one block-table entry and contiguous rows; otherwise the kernels gather row by row,
and any block size works. Softmax uses the online rescaling of FlashAttention (Dao et al. 2022) in
base 2: exp(x) = exp2(x * log2(e)). A float8 cache (SCALED) has a float32 scale per token and KV
head, k_scales/v_scales [num_blocks, block_size, num_kv_heads]. Such tiles are computed in fp16
(a float32 model's in float32): every e4m3 value is exact in fp16 and converts to it in one
instruction (to bf16 it does not); with the block-aligned loads this moved the decode kernel from
0.55 to 0.89 of the copy bandwidth on an H100 (docs/perf-log.md). K enters QK^T as it is, its scales
applied to the scores; V's scales go into P's columns (G x N products, not N x D) before P @ V.
q must then fit fp16 (|q| < 65504; q is RMS-normed in Qwen3).
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.qk_norm_rope import norm_rope, store_heads

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(q, acc, m, l, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr, kv_head, n0,
                 in_range, valid, offs_d, scale_log2, BLOCK_SIZE: tl.constexpr, stride_kb, stride_kt, stride_kh,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr, MASKED: tl.constexpr = True):
    """Fold one tile of keys (positions n0 + [0, BLOCK_N), n0 a multiple of BLOCK_N, loaded where
    in_range [N]; `valid` [M, N] says which query may see which key) into the running (acc, m, l)
    of the queries q [M, D] (fp16 when SCALED, unless float32). Not MASKED: every query sees every
    key of the tile (in_range all true, valid unused), so no masks and no row without a key."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if BLOCK_SIZE % BLOCK_N == 0:  # the tile lies in one block
        block = tl.load(table_ptr + n0 // BLOCK_SIZE).to(tl.int64)
        rows = block * stride_kb + kv_head * stride_kh + (n0 % BLOCK_SIZE + tl.arange(0, BLOCK_N)) * stride_kt
    else:
        block = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        rows = block * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
    if MASKED:
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :])
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :])
    k_scale, v_scale = 1.0, 1.0
    if SCALED:  # contiguous caches: a head vector's scale sits at its row / HEAD_DIM
        k_scale = tl.load(k_scale_ptr + rows // HEAD_DIM, mask=in_range, other=0.0)
        v_scale = tl.load(v_scale_ptr + rows // HEAD_DIM, mask=in_range, other=0.0)
    return _fold(q, k, v, k_scale, v_scale, acc, m, l, valid, scale_log2, SCALED, MASKED)


@triton.jit
def _block_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, k_desc, v_desc, block, n0, kv_head, offs_d,
                BLOCK_SIZE: tl.constexpr, stride_kb, stride_kt, stride_kh, HEAD_DIM: tl.constexpr,
                BLOCK_N: tl.constexpr, SCALED: tl.constexpr, TMA: tl.constexpr):
    """Keys and values [BLOCK_N, HEAD_DIM] at positions n0 + [0, BLOCK_N) of a tile that lies in
    physical block `block` (and their scales when SCALED): through the tensor descriptors k_desc,
    v_desc (TMA: the caches as [num_blocks * BLOCK_SIZE, num_kv_heads * HEAD_DIM]) or pointers."""
    rows = block.to(tl.int64) * stride_kb + kv_head * stride_kh + (n0 % BLOCK_SIZE + tl.arange(0, BLOCK_N)) * stride_kt
    if TMA:
        k = k_desc.load([block * BLOCK_SIZE + n0 % BLOCK_SIZE, kv_head * HEAD_DIM])
        v = v_desc.load([block * BLOCK_SIZE + n0 % BLOCK_SIZE, kv_head * HEAD_DIM])
    else:
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :])
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :])
    k_scale, v_scale = 1.0, 1.0
    if SCALED:
        k_scale = tl.load(k_scale_ptr + rows // HEAD_DIM)
        v_scale = tl.load(v_scale_ptr + rows // HEAD_DIM)
    return k, v, k_scale, v_scale


@triton.jit
def _next_block(table_ptr, n0, table_width, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The physical block of the tile after the one at n0, loaded a tile ahead of its use: a load
    on a tile's own address chain stalls its pipelined K/V loads."""
    ahead = (n0 + BLOCK_N) // BLOCK_SIZE
    return tl.load(table_ptr + ahead, mask=ahead < table_width, other=0)


@triton.jit
def _fold(q, k, v, k_scale, v_scale, acc, m, l, valid, scale_log2, SCALED: tl.constexpr, MASKED: tl.constexpr):
    """The online-softmax step of q [M, D] over keys k and values v [N, D] (float8 ones with their
    per-key scales [N]): (acc, m, l) updated."""
    if SCALED:  # K enters QK^T as it is, its scales applied to the scores
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * (k_scale * scale_log2)[None, :]
    else:
        s = tl.dot(q, tl.trans(k)) * scale_log2
    if MASKED:
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new  # rows that saw no key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if SCALED:  # V's scales go into P's columns
        acc = tl.dot((p * v_scale[None, :]).to(q.dtype), v.to(q.dtype), acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l


@triton.jit
def _split_len(ctx_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per split of a context of ctx_len (whole tiles): split i has keys [i, i + 1) * this,
    cut at ctx_len. The decode kernel and the split reduce both split by it."""
    return tl.cdiv(tl.cdiv(ctx_len, NUM_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _cos_sin(cos_sin_ptr, pos, HEAD_DIM: tl.constexpr):
    """cos and sin [1, HEAD_DIM / 2] (float32) of position pos from the cache [max_position, HEAD_DIM]."""
    d = tl.arange(0, HEAD_DIM // 2)[None, :]
    return tl.load(cos_sin_ptr + pos * HEAD_DIM + d), tl.load(cos_sin_ptr + pos * HEAD_DIM + HEAD_DIM // 2 + d)


@triton.jit
def _decode_q(q_ptr, rows, heads, head_mask, cos, sin, q_weight_ptr, eps, stride_qt, stride_qh,
              HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr,
              SCALED: tl.constexpr):
    """Query head heads[i] of token row rows[i] (both [BLOCK_G]) as [BLOCK_G, HEAD_DIM]: loaded, or
    with ROPE this step's projection normed (NORM: q_weight) and rotated by cos, sin (_cos_sin;
    qk_norm_rope's arithmetic, not written back); fp16 for a float8 cache (unless float32)."""
    if ROPE:
        HALF: tl.constexpr = HEAD_DIM // 2
        d = tl.arange(0, HALF)[None, :]
        q_row = q_ptr + rows[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d
        q1, q2 = norm_rope(tl.load(q_row, mask=head_mask[:, None], other=0.0),
                           tl.load(q_row + HALF, mask=head_mask[:, None], other=0.0), q_weight_ptr, cos, sin, eps,
                           HALF, NORM)
        q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (BLOCK_G, HEAD_DIM))
    else:
        q = tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                    + tl.arange(0, HEAD_DIM)[None, :], mask=head_mask[:, None], other=0.0)
    if SCALED and q.dtype != tl.float32:
        q = q.to(tl.float16)
    return q


@triton.jit
def _store_token(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, cos, sin, k_weight_ptr, eps,
                 slot_ptr, seq, kv_head, stride_knt, stride_vnt, stride_kb, stride_kt, stride_kh,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NORM: tl.constexpr, SCALED: tl.constexpr):
    """Token row seq's k of kv_head (normed, rotated by cos, sin) and v written into the cache at
    its slot (-1: none), visible to the whole program when this returns."""
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF)[None, :]
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    if slot >= 0:
        one = tl.arange(0, 1)
        k_row = k_ptr + seq * stride_knt + kv_head * HEAD_DIM + one[:, None] * 0 + d
        k1, k2 = norm_rope(tl.load(k_row), tl.load(k_row + HALF), k_weight_ptr, cos, sin, eps, HALF, NORM)
        v_row = v_ptr + seq * stride_vnt + kv_head * HEAD_DIM + one[:, None] * 0 + d
        base = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        row = base + one[:, None] * 0 + d
        scale_offs = base // HEAD_DIM + one  # contiguous caches (as _attend_tile finds the scales)
        every = one == 0
        store_heads(k_cache_ptr, k_scale_ptr, row, scale_offs, every, k1, k2, HALF, SCALED)
        store_heads(v_cache_ptr, v_scale_ptr, row, scale_offs, every, tl.load(v_row), tl.load(v_row + HALF), HALF,
                    SCALED)
    tl.debug_barrier()  # the stores above are read back by other threads of this program


@triton.jit
def _decode_heads(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr, kv_head, start, end, row_end,
                  offs_d, scale_log2, BLOCK_SIZE: tl.constexpr, stride_kb, stride_kt, stride_kh,
                  HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr):
    """(acc [G, D], max [G], sum [G]) of the online softmax of query rows q [G, D] (G = BLOCK_G;
    heads of kv_head, of one token or of a few consecutive ones) over the keys [start, end) of
    their sequence, row i over those before row_end[i] (<= end; 0 for a padding row)."""
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        in_range = keys < end
        valid = keys[None, :] < row_end[:, None]
        acc, m, l = _attend_tile(q, acc, m, l, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr,
                                 kv_head, n0, in_range, valid, offs_d, scale_log2, BLOCK_SIZE, stride_kb,
                                 stride_kt, stride_kh, HEAD_DIM, BLOCK_N, SCALED)
    return acc, m, l


@triton.jit
def _store_rows(o_ptr, rows, heads, mask, acc, l, offs_d, stride_ot, stride_oh):
    """acc / l (rows with no key: zeros) into o at token rows x heads (where mask)."""
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(o_ptr + rows[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=mask[:, None])


# The block-table width, the decoding sequences and the q tiles change from step to step: keep them
# out of Triton's specialisation (on 1 and on multiples of 16), which would compile variants mid-run.


def _cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: tuple | None):
    """(k_cache, v_cache, k_scales, v_scales) and the caches' strides, as the kernels take them;
    scales (of float8 caches) need contiguous caches (kernels find them at row / head_dim)."""
    assert k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride()
    if kv_scales is None:
        return (k_cache, v_cache, k_cache, k_cache), (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    assert k_cache.is_contiguous() and all(s.is_contiguous() and s.shape == k_cache.shape[:3] for s in kv_scales)
    return (k_cache, v_cache, *kv_scales), (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
