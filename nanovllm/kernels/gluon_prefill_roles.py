"""The warp-specialised roles of gluon_prefill's persistent kernel: the producer warpgroup (work
items by an atomic counter, Q and K/V through TMA into double buffers) and the two consumer
warpgroups (QK^T and P @ V as wgmma, online softmax), with their helpers."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)


@gluon.jit
def _field(rec, k: gl.constexpr):
    """Field k of an item's record (every thread holds all 8)."""
    return gl.sum(gl.where(gl.arange(0, 8, layout=rec.type.layout) == k, rec, 0), 0)


@gluon.jit
def _prepare_q(q, decode, head_ptr, stride_qh, cos_sin_ptr, q_weight_ptr, eps, m0, q_len, ctx_len, GROUP: gl.constexpr,
               NORM: gl.constexpr):
    """The consumer's Q tile q [BLOCK_M, HEAD_DIM] in shared memory, normed (NORM: q_weight) and
    rotated in place, qk_norm_rope's arithmetic: a q tile's rows (TMA-loaded) at their positions
    (rows past q_len take the last one; their output is not stored); a decoding sequence's from
    the GROUP heads at head_ptr (its token's first head of the KV head), all at its position."""
    TOK: gl.constexpr = q.shape[0]
    HALF: gl.constexpr = q.shape[1] // 2
    rl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    q1s = q.slice(0, HALF, dim=1)
    q2s = q.slice(HALF, HALF, dim=1)
    r = gl.arange(0, TOK, layout=gl.SliceLayout(1, rl))
    d = gl.arange(0, HALF, layout=gl.SliceLayout(0, rl))[None, :]
    if decode:
        rows = head_ptr + r[:, None] * stride_qh
        x1 = gl.load(rows + d, mask=(r < GROUP)[:, None], other=0.0)
        x2 = gl.load(rows + HALF + d, mask=(r < GROUP)[:, None], other=0.0)
    else:
        x1 = q1s.load(rl)
        x2 = q2s.load(rl)
    dtype: gl.constexpr = x1.dtype
    pos = ctx_len - q_len + gl.minimum(m0 + r, q_len - 1)
    cos = gl.load(cos_sin_ptr + pos[:, None] * (2 * HALF) + d).to(dtype)
    sin = gl.load(cos_sin_ptr + pos[:, None] * (2 * HALF) + HALF + d).to(dtype)
    if NORM:  # every step rounded to the model dtype where transformers rounds it
        f1 = x1.to(gl.float32)
        f2 = x2.to(gl.float32)
        inv_rms = gl.rsqrt((gl.sum(f1 * f1, 1) + gl.sum(f2 * f2, 1)) / (2 * HALF) + eps)[:, None]
        x1 = ((f1 * inv_rms).to(dtype) * gl.load(q_weight_ptr + d)).to(dtype)
        x2 = ((f2 * inv_rms).to(dtype) * gl.load(q_weight_ptr + HALF + d)).to(dtype)
    q1s.store(((x1 * cos).to(dtype) - (x2 * sin).to(dtype)).to(dtype))
    q2s.store(((x2 * cos).to(dtype) + (x1 * sin).to(dtype)).to(dtype))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _softmax_step(s_acc, m_i, l_i, qk_scale, offs_m, q_pos, n0, ctx_len, MASKED: gl.constexpr,
                  s_layout: gl.constexpr):
    """Online softmax over one score tile (base 2: qk_scale holds log2(e)); MASKED: causal and past
    the context. Returns (p, the accumulator's rescale, new max, new sum)."""
    if MASKED:
        offs_n = n0 + gl.arange(0, s_acc.shape[1], layout=gl.SliceLayout(0, s_layout))
        valid = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < ctx_len)
        s_acc = gl.where(valid, s_acc, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s_acc, 1) * qk_scale)
    p = gl.exp2(s_acc * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _v_tile(v_bufs, s, n0, ctx_len):
    """V's buffer s, its rows at or past ctx_len zeroed when the tile runs past the context (stale
    slots may hold NaN, and P's zeros would not cancel them)."""
    v = v_bufs.index(s)
    if n0 + v.shape[0] > ctx_len:
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        vals = v.load(blk)
        rows = n0 + gl.arange(0, v.shape[0], layout=gl.SliceLayout(1, blk))
        v.store(gl.where((rows < ctx_len)[:, None], vals, gl.zeros_like(vals)))
        fence_async_shared()
        gl.thread_barrier()
    return v


@gluon.jit
def _producer(descs, bufs, bars, recs, counter_ptr, entries_ptr, n_items, cu_q_ptr, context_lens_ptr,
              block_tables_ptr, stride_bt, SLOTS: gl.constexpr, GROUP: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """Takes items by the atomic counter: item i is entry i // SLOTS and slot i % SLOTS (a q tile's
    head pair; a decoding sequence's KV head, its slots past num_kv_heads skipped). Per item: its
    record into recs, its Q tile (a q tile's: both heads by TMA; a decode's the consumers load), then
    its K/V tiles into the ring. Ends with a record of q tile -2."""
    q_desc, k_desc, v_desc = descs
    q_bufs, k_bufs, v_bufs = bufs
    q_ready, q_empty, k_ready, v_ready, kv_empty = bars
    TOK: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    rec_layout: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])  # every thread holds all 8
    ar = gl.arange(0, 8, layout=rec_layout)
    it = 0  # K/V tiles so far: the ring's position
    n = 0  # items so far: Q's buffer
    i = gl.atomic_add(counter_ptr, 1)
    while i < n_items:
        seq = gl.load(entries_ptr + 2 * (i // SLOTS))
        pid_m = gl.load(entries_ptr + 2 * (i // SLOTS) + 1)
        slot = i % SLOTS
        decode = pid_m < 0
        if (pid_m >= 0) | (slot < SLOTS * 2 // GROUP):
            kv_head = gl.where(decode, slot, 2 * slot // GROUP)
            q_start = gl.load(cu_q_ptr + seq)
            q_len = gl.load(cu_q_ptr + seq + 1) - q_start
            ctx_len = gl.load(context_lens_ptr + seq)
            m0 = gl.maximum(pid_m, 0) * TOK
            n_tiles = gl.cdiv(gl.minimum(ctx_len, ctx_len - q_len + m0 + TOK), BLOCK_N)
            qb = n % 2
            mbarrier.wait(q_empty.index(qb), ((n // 2) & 1) ^ 1)
            rec = gl.where(ar == 0, pid_m, gl.where(ar == 1, slot, gl.where(ar == 2, q_start,
                           gl.where(ar == 3, q_len, ctx_len))))
            recs.index(qb).store(rec)
            gl.thread_barrier()
            if decode:
                mbarrier.arrive(q_ready.index(qb), count=1)
            else:
                mbarrier.expect(q_ready.index(qb), 2 * q_desc.block_type.nbytes)
                for g in gl.static_range(2):
                    tma.async_copy_global_to_shared(q_desc, [q_start + m0, (2 * slot + g) * HEAD_DIM],
                                                    q_ready.index(qb), q_bufs.index(qb).slice(g * TOK, TOK))
            table_ptr = block_tables_ptr + seq * stride_bt
            for j in range(n_tiles):
                s = it % STAGES
                n0 = j * BLOCK_N
                block = gl.load(table_ptr + n0 // BLOCK_SIZE)
                row = block * BLOCK_SIZE + n0 % BLOCK_SIZE
                mbarrier.wait(kv_empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [row, kv_head * HEAD_DIM], k_ready.index(s), k_bufs.index(s))
                mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [row, kv_head * HEAD_DIM], v_ready.index(s), v_bufs.index(s))
                it += 1
            n += 1
        i = gl.atomic_add(counter_ptr, 1)
    qb = n % 2
    mbarrier.wait(q_empty.index(qb), ((n // 2) & 1) ^ 1)
    recs.index(qb).store(gl.full([8], -2, gl.int32, rec_layout))
    gl.thread_barrier()
    mbarrier.arrive(q_ready.index(qb), count=1)


@gluon.jit
def _consumer(WG: gl.constexpr, descs, bufs, bars, recs, q_ptr, stride_qt, stride_qh, o_ptr, stride_ot, stride_oh,
              qk_scale, cos_sin_ptr, q_weight_ptr, eps, NORM: gl.constexpr, GROUP: gl.constexpr):
    """Consumer warpgroup WG: of a q tile's item, query head 2 * slot + WG (64 rows); of a decoding
    sequence's, the GROUP query heads of KV head `slot` as rows, over every other K/V tile (WG 1
    hands its running max, sum and output to WG 0, which merges and stores)."""
    q_desc, k_desc, v_desc, o_desc = descs
    q_bufs, k_bufs, v_bufs, xchg, xml = bufs
    q_ready, q_empty, k_ready, v_ready, kv_empty, m_ready, m_empty = bars
    TOK: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    dtype: gl.constexpr = q_bufs.dtype
    nd = 0  # decode items so far (the exchange buffer's phase)
    rec_layout: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_zero = gl.zeros([TOK, BLOCK_N], gl.float32, layout=s_layout)
    it = 0
    n = 0
    pending = 0  # a TMA store of the last item's output still reads this warpgroup's Q buffer
    mbarrier.wait(q_ready.index(0), 0)
    rec = recs.index(0).load(rec_layout)
    pid_m = _field(rec, 0)
    while pid_m > -2:
        decode = pid_m == -1
        slot = _field(rec, 1)
        q_start = _field(rec, 2)
        q_len = _field(rec, 3)
        ctx_len = _field(rec, 4)
        m0 = gl.maximum(pid_m, 0) * TOK
        n_tiles = gl.cdiv(gl.minimum(ctx_len, ctx_len - q_len + m0 + TOK), BLOCK_N)
        n_unmasked = (ctx_len - q_len + m0 + 1) // BLOCK_N
        partial = m0 + TOK > q_len  # its output goes out masked, not by TMA
        qb = n % 2
        q = q_bufs.index(qb).slice(WG * TOK, TOK)
        if pending != 0:  # the last item's output has left its Q buffer by TMA
            tma.store_wait(0)
            mbarrier.arrive(q_empty.index(1 - qb), count=1)
            pending = 0
        _prepare_q(q, decode, q_ptr + q_start.to(gl.int64) * stride_qt + slot * GROUP * stride_qh, stride_qh,
                   cos_sin_ptr, q_weight_ptr, eps, m0, q_len, ctx_len, GROUP, NORM)
        offs_m = m0 + gl.arange(0, TOK, layout=row_s)
        q_pos = ctx_len - q_len + offs_m
        m_i = gl.full([TOK], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.full([TOK], 0.0, gl.float32, layout=row_s)
        acc = gl.zeros([TOK, HEAD_DIM], gl.float32, layout=o_layout)
        for j in range(n_tiles):
            s = it % STAGES
            mbarrier.wait(k_ready.index(s), (it // STAGES) & 1)
            if decode & (j % 2 != WG):  # the other consumer's tile of a decode item
                mbarrier.arrive(kv_empty.index(s), count=1)
                if j == n_tiles - 1:
                    mbarrier.arrive(q_empty.index(qb), count=1)
            else:
                s_acc = warpgroup_mma(q, k_bufs.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                s_acc = warpgroup_mma_wait(0, deps=(s_acc, ))
                if (j == n_tiles - 1) & partial:
                    mbarrier.arrive(q_empty.index(qb), count=1)  # this item's last use of Q
                if j < n_unmasked:
                    p, alpha, m_i, l_i = _softmax_step(s_acc, m_i, l_i, qk_scale, offs_m, q_pos, j * BLOCK_N, ctx_len,
                                                       False, s_layout)
                else:
                    p, alpha, m_i, l_i = _softmax_step(s_acc, m_i, l_i, qk_scale, offs_m, q_pos, j * BLOCK_N, ctx_len,
                                                       True, s_layout)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                mbarrier.wait(v_ready.index(s), (it // STAGES) & 1)
                acc = warpgroup_mma(p_op, _v_tile(v_bufs, s, j * BLOCK_N, ctx_len), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc, ))
                mbarrier.arrive(kv_empty.index(s), count=1)
            it += 1
        n += 1
        if decode:  # consumer 1's half of the tiles goes to consumer 0
            xl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            if WG == 1:
                mbarrier.wait(m_empty, (nd & 1) ^ 1)
                xchg.store(acc)
                xml.index(0).store(gl.convert_layout(m_i, xl))
                xml.index(1).store(gl.convert_layout(l_i, xl))
                gl.thread_barrier()
                mbarrier.arrive(m_ready, count=1)
            else:
                mbarrier.wait(m_ready, nd & 1)
                acc1 = xchg.load(o_layout)
                m1 = gl.convert_layout(xml.index(0).load(xl), row_s)
                l1 = gl.convert_layout(xml.index(1).load(xl), row_s)
                gl.thread_barrier()
                mbarrier.arrive(m_empty, count=1)
                m_new = gl.maximum(m_i, m1)
                a0 = gl.exp2(m_i - m_new)
                a1 = gl.exp2(m1 - m_new)
                l_i = l_i * a0 + l1 * a1
                acc = acc * gl.convert_layout(a0, row_o)[:, None] + acc1 * gl.convert_layout(a1, row_o)[:, None]
            nd += 1
        l_o = gl.convert_layout(l_i, row_o)
        o = (acc / gl.where(l_o > 0, l_o, 1.0)[:, None]).to(dtype)
        if decode:
            if WG == 0:
                rows = gl.arange(0, TOK, layout=row_o)
                cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
                ptrs = (o_ptr + q_start.to(gl.int64) * stride_ot + (slot * GROUP + rows)[:, None] * stride_oh
                        + cols[None, :])
                gl.store(ptrs, o, mask=(rows < GROUP)[:, None])
        elif partial:
            rows = m0 + gl.arange(0, TOK, layout=row_o)
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            ptrs = (o_ptr + (q_start + rows)[:, None].to(gl.int64) * stride_ot + (2 * slot + WG) * stride_oh
                    + cols[None, :])
            gl.store(ptrs, o, mask=(rows < q_len)[:, None])
        else:
            q.store(o)
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(o_desc, [q_start + m0, (2 * slot + WG) * HEAD_DIM], q)
            pending = 1
        qb = n % 2
        mbarrier.wait(q_ready.index(qb), (n // 2) & 1)
        rec = recs.index(qb).load(rec_layout)
        pid_m = _field(rec, 0)
    tma.store_wait(0)
