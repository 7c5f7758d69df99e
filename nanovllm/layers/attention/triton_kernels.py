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
0.55 to 0.89 of the copy bandwidth on an H100 (NOTES.md). K enters QK^T as it is, its scales
applied to the scores; V's scales go into P's columns (G x N products, not N x D) before P @ V.
q must then fit fp16 (|q| < 65504; q is RMS-normed in Qwen3).
"""
import triton
import triton.language as tl

from nanovllm.layers.pdl import pdl_start
from nanovllm.layers.qk_norm_rope_kernel import norm_rope, store_heads

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
def _decode_q(q_ptr, seq, heads, head_mask, cos, sin, q_weight_ptr, eps, stride_qt, stride_qh,
              HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr,
              SCALED: tl.constexpr):
    """The query heads `heads` [BLOCK_G] of token row `seq` as [BLOCK_G, HEAD_DIM]: loaded, or with
    ROPE this step's projection normed (NORM: q_weight) and rotated by cos, sin (_cos_sin;
    qk_norm_rope's arithmetic, not written back); fp16 for a float8 cache (unless float32)."""
    if ROPE:
        HALF: tl.constexpr = HEAD_DIM // 2
        d = tl.arange(0, HALF)[None, :]
        q_row = q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d
        q1, q2 = norm_rope(tl.load(q_row, mask=head_mask[:, None], other=0.0),
                           tl.load(q_row + HALF, mask=head_mask[:, None], other=0.0), q_weight_ptr, cos, sin, eps,
                           HALF, NORM)
        q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (BLOCK_G, HEAD_DIM))
    else:
        q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + tl.arange(0, HEAD_DIM)[None, :],
                    mask=head_mask[:, None], other=0.0)
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
def _decode_heads(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr, kv_head, start, end, head_mask,
                  offs_d, scale_log2, BLOCK_SIZE: tl.constexpr, stride_kb, stride_kt, stride_kh,
                  HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr):
    """(acc [G, D], max [G], sum [G]) of the online softmax of one token's query heads q [G, D]
    (G = BLOCK_G; those of kv_head where head_mask) over its keys [start, end)."""
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        in_range = n0 + tl.arange(0, BLOCK_N) < end
        valid = in_range[None, :] & head_mask[:, None]
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
@triton.jit(do_not_specialize=["stride_bt", "table_width", "num_decodes", "num_q_tiles"])
def prefill_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tile_k_ptr, tile_v_ptr,
                             k_desc, v_desc, o_ptr, cu_q_ptr, context_lens_ptr, block_tables_ptr, scale_log2,
                             stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
                             table_width, num_decodes, num_q_tiles, cos_sin_ptr, q_weight_ptr, eps,
                             NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                             HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, SCALED: tl.constexpr, TILE_SCALED: tl.constexpr,
                             TMA: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    """1-D grid of a step's programs: one per KV head of each of the first num_decodes sequences
    (one new token each: the decode kernel's loop over the whole context, unsplit), spread evenly
    among one per q tile (num_q_tiles per sequence, those past a sequence's tokens exit) and query
    head of the others, in that order (tile fastest). A q tile's program: causal attention of
    BLOCK_M new tokens of one sequence and head over that sequence's cached keys (its earlier tokens
    and this step's).
    Decode programs are memory-bound and q tiles compute-bound; spread, they share the SMs (as
    POD-Attention, Kamath et al., ASPLOS 2025): H100, 16,384 tokens of which D decode at contexts
    of 1000-2000, us per layer, decode kernel + this kernel's q tiles -> one spread grid: D = 64
    405 -> 383, 128 513 -> 460, 200 674 -> 592 (NOTES.md, 2026-11-26, sixteenth session).
    Where BLOCK_N divides BLOCK_SIZE, the unmasked tiles' block indices are loaded one tile ahead
    (a load on a tile's own address chain stalls its pipelined K/V loads: 245 -> 207 us in a test
    kernel) and with TMA their K/V come through the tensor descriptors k_desc, v_desc. This kernel
    on an H100, Qwen3-0.6B's heads, q rotated inside, bf16: 16 x 1024 tokens 243.5 us with the
    block-table row in registers (before), 242.6 with the index a tile ahead, 224.6 with TMA; 8 x
    2048 403.9, 412.5, 375.1 (NOTES.md, 2026-11-26, fifteenth session).
    With ROPE, q is this step's projection, not yet normed (NORM: q_weight) or rotated: the
    program does that to its tile (qk_norm_rope's arithmetic, at the query's position in its
    sequence), so q makes no round trip through memory before attention.
    Decode programs read k_cache, v_cache (SCALED: float8 with k_scale, v_scale); q tiles read
    tile_k, tile_v through the same block tables and strides (TILE_SCALED: the float8 caches; else
    caches in q's dtype: the model-dtype ones, or a float8 cache's blocks dequantized for this step,
    see dequantize_blocks_kernel)."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    num_decode_programs = num_decodes * NUM_KV_HEADS
    # decode programs among the first pid (+ 1) programs: where the count steps, pid is one
    decodes_before = (pid.to(tl.int64) * num_decode_programs // tl.num_programs(0)).to(tl.int32)
    decodes_upto = ((pid + 1).to(tl.int64) * num_decode_programs // tl.num_programs(0)).to(tl.int32)
    offs_d = tl.arange(0, HEAD_DIM)
    if decodes_upto > decodes_before:
        kv_head, seq = decodes_before % NUM_KV_HEADS, decodes_before // NUM_KV_HEADS  # its token is row seq
        ctx_len = tl.load(context_lens_ptr + seq)
        offs_g = tl.arange(0, BLOCK_G)
        heads, head_mask = kv_head * GROUP + offs_g, offs_g < GROUP
        cos, sin = 0.0, 0.0
        if ROPE:
            cos, sin = _cos_sin(cos_sin_ptr, ctx_len - 1, HEAD_DIM)
        q = _decode_q(q_ptr, seq, heads, head_mask, cos, sin, q_weight_ptr, eps, stride_qt, stride_qh, HEAD_DIM,
                      BLOCK_G, ROPE, NORM, SCALED)
        acc, m, l = _decode_heads(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                  block_tables_ptr + seq * stride_bt, kv_head, 0, ctx_len, head_mask, offs_d,
                                  scale_log2, BLOCK_SIZE, stride_kb, stride_kt, stride_kh, HEAD_DIM, BLOCK_G,
                                  BLOCK_N, SCALED)
        _store_rows(o_ptr, seq + offs_g * 0, heads, head_mask, acc, l, offs_d, stride_ot, stride_oh)
    else:
        tile = pid - decodes_upto
        pid_m, head = tile % num_q_tiles, tile // num_q_tiles % (NUM_KV_HEADS * GROUP)
        seq = num_decodes + tile // (num_q_tiles * NUM_KV_HEADS * GROUP)
        q_start = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_start
        if pid_m * BLOCK_M < q_len:
            _prefill_tile(q_ptr, tile_k_ptr, tile_v_ptr, k_scale_ptr, v_scale_ptr, k_desc, v_desc, o_ptr,
                          block_tables_ptr + seq * stride_bt, pid_m, head, q_start, q_len,
                          tl.load(context_lens_ptr + seq), offs_d, scale_log2, stride_qt, stride_qh, stride_ot,
                          stride_oh, stride_kb, stride_kt, stride_kh, table_width, cos_sin_ptr, q_weight_ptr, eps,
                          GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, TILE_SCALED, TMA, ROPE, NORM)


@triton.jit
def _prefill_tile(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, k_desc, v_desc, o_ptr, table_ptr, pid_m,
                  head, q_start, q_len, ctx_len, offs_d, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh,
                  stride_kb, stride_kt, stride_kh, table_width, cos_sin_ptr, q_weight_ptr, eps, GROUP: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SCALED: tl.constexpr, TMA: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr):
    """prefill_attention_kernel's q tile pid_m of one sequence (tokens q_start.., q_len of them, the
    last ones of its ctx_len) and head."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = ctx_len - q_len + offs_m  # absolute positions of the queries
    q_rows = q_ptr + (q_start + offs_m)[:, None].to(tl.int64) * stride_qt + head * stride_qh
    q_mask = (offs_m < q_len)[:, None]
    if ROPE:
        HALF: tl.constexpr = HEAD_DIM // 2
        d = tl.arange(0, HALF)[None, :]
        cos = tl.load(cos_sin_ptr + q_pos[:, None] * HEAD_DIM + d, mask=q_mask, other=0.0)
        sin = tl.load(cos_sin_ptr + q_pos[:, None] * HEAD_DIM + HALF + d, mask=q_mask, other=0.0)
        q1, q2 = norm_rope(tl.load(q_rows + d, mask=q_mask, other=0.0), tl.load(q_rows + HALF + d, mask=q_mask,
                           other=0.0), q_weight_ptr, cos, sin, eps, HALF, NORM)
        q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (BLOCK_M, HEAD_DIM))
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)
    if SCALED and q.dtype != tl.float32:
        q = q.to(tl.float16)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    end = tl.minimum(ctx_len, ctx_len - q_len + (pid_m + 1) * BLOCK_M)
    # tiles wholly at or before the tile's first query need no mask (FlashAttention-2's split of
    # the causal loop); the rest, up to the diagonal, are masked
    unmasked_end = (ctx_len - q_len + pid_m * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    if BLOCK_SIZE % BLOCK_N == 0:  # tiles in one block each: the next tile's block index loaded ahead
        next_block = tl.load(table_ptr)
        for n0 in range(0, unmasked_end, BLOCK_N):
            block, next_block = next_block, _next_block(table_ptr, n0, table_width, BLOCK_SIZE, BLOCK_N)
            k, v, k_scale, v_scale = _block_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, k_desc, v_desc,
                                                 block, n0, head // GROUP, offs_d, BLOCK_SIZE, stride_kb, stride_kt,
                                                 stride_kh, HEAD_DIM, BLOCK_N, SCALED, TMA)
            acc, m, l = _fold(q, k, v, k_scale, v_scale, acc, m, l, None, scale_log2, SCALED, False)
    else:
        every_key = tl.full([BLOCK_N], True, tl.int1)
        for n0 in range(0, unmasked_end, BLOCK_N):
            acc, m, l = _attend_tile(q, acc, m, l, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr,
                                     head // GROUP, n0, every_key, None, offs_d, scale_log2, BLOCK_SIZE, stride_kb,
                                     stride_kt, stride_kh, HEAD_DIM, BLOCK_N, SCALED, False)
    for n0 in range(unmasked_end, end, BLOCK_N):  # up to the diagonal: masked, the block read per tile
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_range = offs_n < end
        valid = (offs_n[None, :] <= q_pos[:, None]) & in_range[None, :]
        acc, m, l = _attend_tile(q, acc, m, l, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr,
                                 head // GROUP, n0, in_range, valid, offs_d, scale_log2, BLOCK_SIZE, stride_kb,
                                 stride_kt, stride_kh, HEAD_DIM, BLOCK_N, SCALED, True)
    _store_rows(o_ptr, q_start + offs_m, head + offs_m * 0, offs_m < q_len, acc, l, offs_d, stride_ot, stride_oh)


@triton.jit(do_not_specialize=["stride_bt"])
def decode_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, o_ptr, acc_ptr, ml_ptr,
                            context_lens_ptr, block_tables_ptr, scale_log2, stride_qt, stride_qh, stride_ot,
                            stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
                            k_ptr, v_ptr, stride_knt, stride_vnt, positions_ptr, cos_sin_ptr, q_weight_ptr,
                            k_weight_ptr, eps, slot_ptr, GROUP: tl.constexpr,
                            BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SCALED: tl.constexpr,
                            ROPE: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    """Grid (num_kv_heads, num_seqs, NUM_SPLITS): one query token per sequence (flash-decoding).
    Heads vary fastest so that the GPU starts every head of the first sequences first: with the
    batch ordered longest context first, that is longest-processing-time-first scheduling.
    Each program reads one KV head's keys once for all GROUP query heads that share it, over its
    share of the context. With one split it writes the output; otherwise it writes the partial
    (acc [D], max, sum) per head and split for reduce_splits_kernel.
    With ROPE, q and the token's k, v are this step's projections, not yet normed, rotated or
    stored: every program norms and rotates its q heads (qk_norm_rope's arithmetic), and the
    program whose keys end at the token first stores its k and v (qk_norm_rope_kernel's work, one
    kernel fewer per layer)."""
    pdl_start(PDL)
    kv_head, seq, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx_len = tl.load(context_lens_ptr + seq)
    per_split = _split_len(ctx_len, NUM_SPLITS, BLOCK_N)
    start = split * per_split
    if NUM_SPLITS > 1 and start >= ctx_len:  # no keys: reduce_splits_kernel skips this split
        return
    end = tl.minimum(start + per_split, ctx_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads, head_mask = kv_head * GROUP + offs_g, offs_g < GROUP
    cos, sin = 0.0, 0.0
    if ROPE:
        cos, sin = _cos_sin(cos_sin_ptr, tl.load(positions_ptr + seq), HEAD_DIM)
    q = _decode_q(q_ptr, seq, heads, head_mask, cos, sin, q_weight_ptr, eps, stride_qt, stride_qh, HEAD_DIM,
                  BLOCK_G, ROPE, NORM, SCALED)
    if ROPE:
        if (end == ctx_len) & (ctx_len > 0):
            _store_token(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, cos, sin, k_weight_ptr,
                         eps, slot_ptr, seq, kv_head, stride_knt, stride_vnt, stride_kb, stride_kt, stride_kh,
                         HEAD_DIM, BLOCK_SIZE, NORM, SCALED)
    acc, m, l = _decode_heads(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr + seq * stride_bt,
                              kv_head, start, end, head_mask, offs_d, scale_log2, BLOCK_SIZE, stride_kb, stride_kt,
                              stride_kh, HEAD_DIM, BLOCK_G, BLOCK_N, SCALED)
    if NUM_SPLITS == 1:
        _store_rows(o_ptr, seq + offs_g * 0, heads, head_mask, acc, l, offs_d, stride_ot, stride_oh)
    else:
        num_heads = tl.num_programs(0) * GROUP
        part = (seq * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_G] rows of [num_seqs, num_heads, NUM_SPLITS]
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=head_mask[:, None])
        tl.store(ml_ptr + part * 2, m, mask=head_mask)
        tl.store(ml_ptr + part * 2 + 1, l, mask=head_mask)


@triton.jit
def reduce_splits_kernel(o_ptr, acc_ptr, ml_ptr, context_lens_ptr, stride_ot, stride_oh, GROUP: tl.constexpr,
                         MERGE_G: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         SPLIT_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """Grid (num_seqs, num_kv_heads): the partial softmaxes (acc [D], max, sum) that
    decode_attention_kernel wrote for the GROUP query heads of one KV head (MERGE_G >= GROUP
    rows) merged, SPLIT_CHUNK splits per step, from the splits that had keys only (none for a
    context of 0: zeros)."""
    pdl_start(PDL)
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    ctx_len = tl.load(context_lens_ptr + seq)
    num_splits = tl.cdiv(ctx_len, tl.maximum(_split_len(ctx_len, NUM_SPLITS, BLOCK_N), 1))
    offs_g = tl.arange(0, MERGE_G)
    heads, head_mask = kv_head * GROUP + offs_g, offs_g < GROUP
    offs_s = tl.arange(0, SPLIT_CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    m_run = tl.full([MERGE_G], float("-inf"), tl.float32)
    l_run = tl.zeros([MERGE_G], tl.float32)
    o_run = tl.zeros([MERGE_G, HEAD_DIM], tl.float32)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        splits = s0 + offs_s
        mask = head_mask[:, None] & (splits < num_splits)[None, :]  # [G, S]
        part = (seq * tl.num_programs(1) * GROUP + heads[:, None]) * NUM_SPLITS + splits[None, :]
        m = tl.load(ml_ptr + part * 2, mask=mask, other=float("-inf"))
        l = tl.load(ml_ptr + part * 2 + 1, mask=mask, other=0.0)
        acc = tl.load(acc_ptr + part[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=mask[:, :, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # heads that have seen no keys yet
        w = tl.exp2(m - m_safe[:, None])  # 0 where masked (m = -inf)
        alpha = tl.exp2(m_run - m_safe)
        l_run = l_run * alpha + tl.sum(l * w, 1)
        o_run = o_run * alpha[:, None] + tl.sum(acc * w[:, :, None], 1)
        m_run = m_new
    o = o_run / tl.where(l_run > 0, l_run, 1.0)[:, None]
    tl.store(o_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=head_mask[:, None])



@triton.jit
def dequantize_blocks_kernel(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, k_out_ptr, v_out_ptr, src_ptr,
                             ROWS_PER_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
    """Grid (blocks, cdiv(ROWS_PER_BLOCK, BLOCK_R)): block j of k_out, v_out (contiguous
    [n, block_size, num_kv_heads, HEAD_DIM] in the model dtype) = float8 block src[j] of the
    contiguous caches times its scales, BLOCK_R head vectors (rows) per program."""
    j, r = tl.program_id(0), tl.program_id(1)
    rows = r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = rows < ROWS_PER_BLOCK
    src_rows = tl.load(src_ptr + j).to(tl.int64) * ROWS_PER_BLOCK + rows
    out_rows = j.to(tl.int64) * ROWS_PER_BLOCK + rows
    _dequantize_rows(k_cache_ptr, k_scale_ptr, k_out_ptr, src_rows, out_rows, mask, HEAD_DIM)
    _dequantize_rows(v_cache_ptr, v_scale_ptr, v_out_ptr, src_rows, out_rows, mask, HEAD_DIM)


@triton.jit
def _dequantize_rows(cache_ptr, scale_ptr, out_ptr, src_rows, out_rows, mask, HEAD_DIM: tl.constexpr):
    d = tl.arange(0, HEAD_DIM)[None, :]
    x = tl.load(cache_ptr + src_rows[:, None] * HEAD_DIM + d, mask=mask[:, None]).to(tl.float32)
    x = x * tl.load(scale_ptr + src_rows, mask=mask)[:, None]
    tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + d, x.to(out_ptr.dtype.element_ty), mask=mask[:, None])
