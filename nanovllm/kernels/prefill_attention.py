"""Paged prefill attention (a packed step's new tokens over the cache) and the float8 cache's
dequantization into a staging area; the tiles and the cache layout are attention.py's."""
import numpy as np
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.attention import (LOG2E, _attend_tile, _block_tile, _cache_args, _cos_sin, _decode_heads,
                                        _decode_q, _fold, _next_block, _store_rows)
from nanovllm.kernels.pdl import hopper, pdl_args, pdl_start
from nanovllm.kernels.qk_norm_rope import norm_rope

PREFILL_BLOCK_M, PREFILL_BLOCK_N = 64, 64


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
    405 -> 383, 128 513 -> 460, 200 674 -> 592 (docs/perf-log.md, 2026-11-26).
    Where BLOCK_N divides BLOCK_SIZE, the unmasked tiles' block indices are loaded one tile ahead
    (a load on a tile's own address chain stalls its pipelined K/V loads: 245 -> 207 us in a test
    kernel) and with TMA their K/V come through the tensor descriptors k_desc, v_desc. This kernel
    on an H100, Qwen3-0.6B's heads, q rotated inside, bf16: 16 x 1024 tokens 243.5 us with the
    block-table row in registers (before), 242.6 with the index a tile ahead, 224.6 with TMA; 8 x
    2048 403.9, 412.5, 375.1 (docs/perf-log.md, 2026-11-26).
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
        q = _decode_q(q_ptr, seq + offs_g * 0, heads, head_mask, cos, sin, q_weight_ptr, eps, stride_qt, stride_qh,
                      HEAD_DIM, BLOCK_G, ROPE, NORM, SCALED)
        acc, m, l = _decode_heads(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                  block_tables_ptr + seq * stride_bt, kv_head, 0, ctx_len,
                                  tl.where(head_mask, ctx_len, 0), offs_d,
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


def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, max_seqlen_q, scale, out=None,
                      kv_scales=None, block_m=PREFILL_BLOCK_M, block_n=PREFILL_BLOCK_N, num_warps=4, num_stages=3,
                      new_q=None, num_decodes=0, tma=None, tile_kv=None):
    """Causal attention of the packed new tokens q: [T, num_heads, head_dim] (sequence i's at
    cu_seqlens_q[i]:cu_seqlens_q[i+1], the last ones of its context_lens[i] tokens, so at positions
    context_lens[i] - n .. context_lens[i] - 1) over the paged cache; kv_scales: (k_scales, v_scales)
    of a float8 cache, else None. new_q: None (q final), or (cos_sin_cache, q_weight or None, eps) as
    qk_norm_rope takes them: q is then normed and rotated inside the kernel (not written). That saves
    q's read and write in qk_norm_rope's kernel: at 16 x 1024 tokens of Qwen3-0.6B on an H100 that
    kernel 110.6 -> 53.4 us, this one 236.5 -> 247.3 (docs/perf-log.md, 2026-11-26).
    num_decodes: the first num_decodes sequences have one new token each (so q rows 0 ..
    num_decodes - 1) and get one program per KV head over their whole context, as the decode
    kernel's (see prefill_attention_kernel), instead of a q tile per head. tma: K/V tiles
    through tensor descriptors (Hopper's TMA; None: where the device has it, and in Triton's
    interpreter), else through pointers; caches that are not contiguous, head vectors under 16
    bytes, or tiles that do not divide the block size take pointers either way.
    tile_kv: None, or (k, v) [n, block_size, num_kv_heads, head_dim] in q's dtype that the q tiles
    read instead of a float8 cache (dequantize_blocks' staging area; block_tables' rows of the
    sequences after the first num_decodes then index it), while decode programs read the cache."""
    out = torch.empty_like(q) if out is None else out
    num_heads, head_dim, num_kv_heads = q.size(1), q.size(2), k_cache.size(2)
    q_tiles = triton.cdiv(max_seqlen_q, block_m)
    programs = q_tiles * num_heads * (context_lens.size(0) - num_decodes) + num_decodes * num_kv_heads
    caches, strides = _cache_args(k_cache, v_cache, kv_scales)
    tile_k, tile_v = tile_kv or (k_cache, v_cache)
    assert tile_k.stride() == tile_v.stride() == k_cache.stride() and tile_k.dtype == tile_v.dtype
    if tma is None:  # Hopper's copy engine, or Triton's interpreter on the CPU
        tma = hopper(q.device) or q.device.type == "cpu"
    tma = (tma and k_cache.size(1) % block_n == 0 and tile_k.is_contiguous() and tile_v.is_contiguous()
           and head_dim * tile_k.element_size() >= 16)  # a TMA box row holds 16 bytes at least
    descs = [TensorDescriptor.from_tensor(c.view(-1, c.size(2) * head_dim), [block_n, head_dim])
             for c in (tile_k, tile_v)] if tma else (q, q)
    cos_sin, q_weight, eps = new_q or (q, None, 0.0)
    prefill_attention_kernel[(programs,)](
        q, *caches, tile_k, tile_v, *descs, out, cu_seqlens_q, context_lens, block_tables, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *strides, block_tables.stride(0),
        block_tables.size(1), num_decodes, q_tiles, cos_sin, q if q_weight is None else q_weight, eps,
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads,
        BLOCK_G=max(16, triton.next_power_of_2(num_heads // num_kv_heads)), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.size(1), BLOCK_M=block_m, BLOCK_N=block_n, SCALED=kv_scales is not None,
        TILE_SCALED=kv_scales is not None and tile_kv is None, TMA=tma, ROPE=new_q is not None,
        NORM=q_weight is not None, num_warps=num_warps, num_stages=num_stages, **pdl_args(q.device))
    return out


def staging_plan(block_tables: np.ndarray, context_lens: np.ndarray, first_seq: int, block_size: int,
                 capacity: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The blocks that sequences first_seq.. of a step read (block_tables [B, max_blocks], -1
    padded; context_lens [B]), each once, in order of block id, and the block tables with those
    rows renumbered to index that list; None when they are more than `capacity`."""
    tables = block_tables[first_seq:]
    used = np.arange(tables.shape[1])[None, :] < -(-context_lens[first_seq:, None] // block_size)
    blocks, index = np.unique(tables[used], return_inverse=True)
    if blocks.size > capacity:
        return None
    staged = block_tables.copy()
    staged[first_seq:][used] = index
    return blocks, staged


def dequantize_blocks(k_cache, v_cache, kv_scales, blocks, staging, rows_per_program=16):
    """The float8 caches' blocks `blocks` [n] (int32), times their scales, into staging[0][:n] (K)
    and staging[1][:n] (V) ([2, >= n, block_size, num_kv_heads, head_dim], the model dtype);
    returns (staging[0], staging[1])."""
    (k_cache, v_cache, k_scales, v_scales), _ = _cache_args(k_cache, v_cache, kv_scales)
    assert staging.is_contiguous() and staging.shape[2:] == k_cache.shape[1:]
    rows = k_cache.size(1) * k_cache.size(2)  # head vectors per block
    dequantize_blocks_kernel[(blocks.size(0), triton.cdiv(rows, rows_per_program))](
        k_cache, v_cache, k_scales, v_scales, staging[0], staging[1], blocks, ROWS_PER_BLOCK=rows,
        HEAD_DIM=k_cache.size(3), BLOCK_R=rows_per_program)
    return staging[0], staging[1]
