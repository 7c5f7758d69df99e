"""Paged decode attention: one new token per sequence (or a few: a verify run's) over its cached
context, split over the context (flash-decoding) where the batch alone does not fill the GPU;
tiles and layout are attention.py's."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention import (LOG2E, _cache_args, _cos_sin, _decode_heads, _decode_q,
                                        _split_len, _store_rows, _store_token)
from nanovllm.kernels.pdl import num_sms, pdl_args, pdl_start

DECODE_BLOCK_N = 64


@triton.jit(do_not_specialize=["stride_bt"])
def decode_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, o_ptr, acc_ptr, ml_ptr,
                            context_lens_ptr, block_tables_ptr, scale_log2, stride_qt, stride_qh, stride_ot,
                            stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
                            k_ptr, v_ptr, stride_knt, stride_vnt, positions_ptr, cos_sin_ptr, q_weight_ptr,
                            k_weight_ptr, eps, slot_ptr, GROUP: tl.constexpr, Q_LEN: tl.constexpr,
                            BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SCALED: tl.constexpr,
                            ROPE: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    """Grid (num_kv_heads, num_seqs, NUM_SPLITS): each sequence's last Q_LEN tokens (token rows
    seq * Q_LEN + j; one in a decode step, 1 + k when verifying k drafts), causally: token j sees
    the context_len - (Q_LEN - 1 - j) keys before it and itself (flash-decoding).
    Heads vary fastest so that the GPU starts every head of the first sequences first: with the
    batch ordered longest context first, that is longest-processing-time-first scheduling.
    Each program reads one KV head's keys once for the Q_LEN x GROUP query rows that share it
    (token-major in BLOCK_G rows), over its share of the context. With one split it writes the
    output; otherwise it writes the partial (acc [D], max, sum) per row and split for
    reduce_splits_kernel.
    With ROPE (Q_LEN 1), q and the token's k, v are this step's projections, not yet normed,
    rotated or stored: every program norms and rotates its q heads (qk_norm_rope's arithmetic),
    and the program whose keys end at the token first stores its k and v (qk_norm_rope's work,
    one kernel fewer per layer)."""
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
    token = offs_g // GROUP  # of the sequence's Q_LEN
    rows, heads, row_mask = seq * Q_LEN + token, kv_head * GROUP + offs_g % GROUP, offs_g < Q_LEN * GROUP
    cos, sin = 0.0, 0.0
    if ROPE:
        cos, sin = _cos_sin(cos_sin_ptr, tl.load(positions_ptr + seq), HEAD_DIM)
    q = _decode_q(q_ptr, rows, heads, row_mask, cos, sin, q_weight_ptr, eps, stride_qt, stride_qh, HEAD_DIM,
                  BLOCK_G, ROPE, NORM, SCALED)
    if ROPE:
        if (end == ctx_len) & (ctx_len > 0):
            _store_token(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, cos, sin, k_weight_ptr,
                         eps, slot_ptr, seq, kv_head, stride_knt, stride_vnt, stride_kb, stride_kt, stride_kh,
                         HEAD_DIM, BLOCK_SIZE, NORM, SCALED)
    row_end = tl.where(row_mask, tl.minimum(end, ctx_len - (Q_LEN - 1 - token)), 0)
    acc, m, l = _decode_heads(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr + seq * stride_bt,
                              kv_head, start, end, row_end, offs_d, scale_log2, BLOCK_SIZE, stride_kb, stride_kt,
                              stride_kh, HEAD_DIM, BLOCK_G, BLOCK_N, SCALED)
    if NUM_SPLITS == 1:
        _store_rows(o_ptr, rows, heads, row_mask, acc, l, offs_d, stride_ot, stride_oh)
    else:
        num_heads = tl.num_programs(0) * GROUP
        part = (rows * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_G] rows of [num_tokens, num_heads, NUM_SPLITS]
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_mask[:, None])
        tl.store(ml_ptr + part * 2, m, mask=row_mask)
        tl.store(ml_ptr + part * 2 + 1, l, mask=row_mask)


@triton.jit
def reduce_splits_kernel(o_ptr, acc_ptr, ml_ptr, context_lens_ptr, stride_ot, stride_oh, GROUP: tl.constexpr,
                         Q_LEN: tl.constexpr, MERGE_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                         PDL: tl.constexpr):
    """Grid (num_tokens, num_kv_heads): the partial softmaxes (acc [D], max, sum) that
    decode_attention_kernel wrote for one token's GROUP query heads of one KV head (MERGE_G >=
    GROUP rows) merged, SPLIT_CHUNK splits per step, from the splits that had keys only (none for
    a context of 0: zeros); the token's sequence is token // Q_LEN."""
    pdl_start(PDL)
    seq, kv_head = tl.program_id(0), tl.program_id(1)  # seq: the token row
    ctx_len = tl.load(context_lens_ptr + seq // Q_LEN)
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


def decode_num_splits(num_seqs: int, num_kv_heads: int, group: int, device: torch.device) -> int:
    """Splits of each context so that at least 8 programs per SM run at any batch size (flash-decoding),
    but none (and no reduce kernel) where the grid already has 4 programs per SM, or 3 with 8 or
    more query heads per KV head (group). On an H200 with lengths of 100..2000 tokens:
    - 2 query heads per KV head (Qwen3-0.6B): batch 64 reads K/V at 0.63 of the copy bandwidth
      with 1 split, 0.67 with 2, 0.70 with 4, 0.71 with 8; batch 256 at 0.88 with 1 or 2 splits,
      0.83 with 4 (benchmarks/decode_attention.py --varied). A sweep of splits, BLOCK_N and stages
      (--sweep) found faster choices for batches of 32-128 alone (e.g. batch 32: 0.64 with 2
      splits, BLOCK_N 128, 3-4 stages, against 0.38), but bench.py did not move with them.
      Unsplit from 4 programs per SM: H100 default bench.py 6.415 against 6.437 s (4 runs each),
      `--num-seqs 64` unchanged (docs/perf-log.md, 2026-11-26).
    - 8 (Qwen3-30B-A3B at tensor parallelism 2: 16 heads, 2 KV heads): batch 256, 512 programs
      on 132 SMs, 93.1 us with 1 split against 120.1 with 2 and 133.2 with 4, where Qwen3-0.6B's
      batch 64, also 512 programs, takes 88.8, 83.8 and 84.6 (2026-11-28)."""
    if device.type != "cuda":
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= (3 if group >= 8 else 4) * num_sms(device.index or 0):
        return 1
    return min(64, triton.next_power_of_2(max(1, -(-8 * num_sms(device.index or 0) // programs))))


MAX_QUERY_ROWS = 64  # a program's query rows (q_len x heads per KV head): its tile's height


def decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale, num_splits=None, out=None,
                     kv_scales=None, block_n=DECODE_BLOCK_N, num_warps=None, num_stages=2, new_token=None, q_len=1):
    """Attention of each sequence's last q_len tokens, q: [num_seqs * q_len, num_heads, head_dim]
    (sequence-major), over its context_lens[i] cached keys (theirs included), causally: token j of
    a sequence sees context_lens[i] - (q_len - 1 - j) keys. q_len 1 is a decode step; 1 + k
    verifies k drafts. Context length 0 gives zeros (padding rows of CUDA graphs). q_len times the
    query heads per KV head must be at most MAX_QUERY_ROWS (AssertionError).
    kv_scales: (k_scales, v_scales) of a float8 cache, else None. num_warps: by default 4, or 2 for
    a float8 cache (the fastest of a sweep of tile variants on an H100 at batch 256, docs/perf-log.md,
    2026-11-24). new_token (q_len 1 only): None (q final, the token's k and v already in the
    cache), or (k [num_seqs, num_kv_heads, head_dim], v (same), positions [num_seqs] int64,
    cos_sin_cache, q_weight, k_weight, eps, slot_mapping [num_seqs]) as qk_norm_rope takes them:
    q and k are then normed (weights not None) and rotated, and k, v stored at slot_mapping,
    inside the kernel; q is not written."""
    out = torch.empty_like(q) if out is None else out
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = num_tokens // q_len, k_cache.size(2)
    group = num_heads // num_kv_heads
    assert num_seqs * q_len == num_tokens and q_len * group <= MAX_QUERY_ROWS and (q_len == 1 or new_token is None)
    splits = num_splits or decode_num_splits(num_seqs, num_kv_heads, group, q.device)
    acc = ml = out  # unused when splits == 1
    if splits > 1:
        acc = torch.empty(num_tokens, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(num_tokens, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    caches, strides = _cache_args(k_cache, v_cache, kv_scales)
    k, v, positions, cos_sin, q_weight, k_weight, eps, slots = new_token or (q, q, context_lens, q, None, None, 0.0,
                                                                           context_lens)
    if new_token is not None:
        assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == head_dim
        assert kv_scales is None or k_cache.is_contiguous()
    decode_attention_kernel[(num_kv_heads, num_seqs, splits)](
        q, *caches, out, acc, ml, context_lens, block_tables, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *strides, block_tables.stride(0),
        k, v, k.stride(0), v.stride(0), positions, cos_sin, q if q_weight is None else q_weight,
        q if k_weight is None else k_weight, eps, slots, ROPE=new_token is not None, NORM=q_weight is not None,
        GROUP=group, Q_LEN=q_len, BLOCK_G=max(16, triton.next_power_of_2(q_len * group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.size(1), BLOCK_N=block_n, NUM_SPLITS=splits, SCALED=kv_scales is not None,
        num_warps=num_warps or (4 if kv_scales is None else 2), num_stages=num_stages, **pdl_args(q.device))
    if splits > 1:
        # one program per token and KV head merges its query heads' partials, 32 // heads splits per step
        merge_g = triton.next_power_of_2(group)
        chunk = min(splits, max(1, 32 // merge_g))
        reduce_splits_kernel[(num_tokens, num_kv_heads)](out, acc, ml, context_lens, out.stride(0), out.stride(1),
                                                         GROUP=group, Q_LEN=q_len, MERGE_G=merge_g, HEAD_DIM=head_dim,
                                                         NUM_SPLITS=splits, SPLIT_CHUNK=chunk, BLOCK_N=block_n,
                                                         **pdl_args(q.device))
    return out
