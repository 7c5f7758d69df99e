"""Our own paged-attention backend: the Triton kernels of triton_kernels.py and qk_norm_rope_kernel.py."""
import functools

import numpy as np
import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.layers.attention.base import AttentionBackend
from nanovllm.layers.attention.triton_kernels import (LOG2E, decode_attention_kernel, dequantize_blocks_kernel,
                                                      prefill_attention_kernel, reduce_splits_kernel)
from nanovllm.layers.pdl import hopper, pdl_args
from nanovllm.layers.qk_norm_rope_kernel import qk_norm_rope, rope_store_kv

PREFILL_BLOCK_M, PREFILL_BLOCK_N, DECODE_BLOCK_N = 64, 64, 64
# A mixed step's first sequences with one new token each (the decoding ones) get decode programs in
# prefill attention's grid from this many on; below, 64-row q tiles like the others (H100, a step of
# 16,384 tokens, decoding contexts 1000-2000, us per layer, q tiles -> decode programs: bf16 8 of them
# 332.4 -> 337.8, 16 369.8 -> 366.6, 32 426.7 -> 386.3, 200 877.4 -> 638.0; float8 8 610.8 -> 593.5,
# 200 1424.0 -> 868.5; NOTES.md, 2026-11-26, sixteenth session).
DECODE_PROGRAMS_FROM = 16
# A float8 cache's decode steps store the new token inside the attention kernel up to this many
# sequences; beyond, every split program's float8 store and q rotation cost more than the kernel
# they save (H100, Qwen3-0.6B, graph us separate -> fused: 1 sequence 902 -> 858, 8 1193 -> 1141,
# 16 1325 -> 1314, 32 1673 -> 1720, 256 5590 -> 5808; NOTES.md, 2026-11-25, sixth session).
FUSED_FP8_MAX_SEQS = 16


def _cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: tuple | None):
    """(k_cache, v_cache, k_scales, v_scales) and the caches' strides, as the kernels take them;
    scales (of float8 caches) need contiguous caches (kernels find them at row / head_dim)."""
    assert k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride()
    if kv_scales is None:
        return (k_cache, v_cache, k_cache, k_cache), (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    assert k_cache.is_contiguous() and all(s.is_contiguous() and s.shape == k_cache.shape[:3] for s in kv_scales)
    return (k_cache, v_cache, *kv_scales), (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))


def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, max_seqlen_q, scale, out=None,
                      kv_scales=None, block_m=PREFILL_BLOCK_M, block_n=PREFILL_BLOCK_N, num_warps=4, num_stages=3,
                      new_q=None, num_decodes=0, tma=None, tile_kv=None):
    """Causal attention of the packed new tokens q: [T, num_heads, head_dim] (sequence i's at
    cu_seqlens_q[i]:cu_seqlens_q[i+1], the last ones of its context_lens[i] tokens, so at positions
    context_lens[i] - n .. context_lens[i] - 1) over the paged cache; kv_scales: (k_scales, v_scales)
    of a float8 cache, else None. new_q: None (q final), or (cos_sin_cache, q_weight or None, eps) as
    qk_norm_rope takes them: q is then normed and rotated inside the kernel (not written). That saves
    q's read and write in qk_norm_rope_kernel: at 16 x 1024 tokens of Qwen3-0.6B on an H100 that
    kernel 110.6 -> 53.4 us, this one 236.5 -> 247.3 (NOTES.md, 2026-11-26, fourteenth session).
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


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits of each context so that at least 8 programs per SM run at any batch size (flash-decoding),
    but none (and no reduce kernel) where the grid already has 4 programs per SM. On an H200 with
    lengths of 100..2000 tokens: batch 64 reads K/V at 0.63 of the copy bandwidth with 1 split, 0.67
    with 2, 0.70 with 4, 0.71 with 8; batch 256 at 0.88 with 1 or 2 splits, 0.83 with 4
    (benchmarks/decode_attention.py --varied). A sweep of splits, BLOCK_N and stages (--sweep) found
    faster choices for batches of 32-128 alone (e.g. batch 32: 0.64 with 2 splits, BLOCK_N 128, 3-4
    stages, against 0.38), but bench.py did not move with them. Unsplit from 4 programs per SM: H100
    default bench.py 6.415 against 6.437 s (4 runs each), `--num-seqs 64` unchanged (NOTES.md,
    2026-11-26, thirteenth session)."""
    if device.type != "cuda":
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= 4 * _num_sms(device.index or 0):
        return 1
    return min(64, triton.next_power_of_2(max(1, -(-8 * _num_sms(device.index or 0) // programs))))


def decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale, num_splits=None, out=None,
                     kv_scales=None, block_n=DECODE_BLOCK_N, num_warps=None, num_stages=2, new_token=None):
    """Attention of one new token per sequence, q: [num_seqs, num_heads, head_dim], over its
    context_lens[i] cached keys; context length 0 gives zeros (padding rows of CUDA graphs).
    kv_scales: (k_scales, v_scales) of a float8 cache, else None. num_warps: by default 4, or 2 for
    a float8 cache (the fastest of a sweep of tile variants on an H100 at batch 256, NOTES.md
    2026-11-24). new_token: None (q final, the token's k and v already in the cache), or (k
    [num_seqs, num_kv_heads, head_dim], v (same), positions [num_seqs] int64, cos_sin_cache,
    q_weight, k_weight, eps, slot_mapping [num_seqs]) as qk_norm_rope takes them: q and k are
    then normed (weights not None) and rotated, and k, v stored at slot_mapping, inside the
    kernel; q is not written."""
    out = torch.empty_like(q) if out is None else out
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.size(2)
    group = num_heads // num_kv_heads
    splits = num_splits or decode_num_splits(num_seqs, num_kv_heads, q.device)
    acc = ml = out  # unused when splits == 1
    if splits > 1:
        acc = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(num_seqs, num_heads, splits, 2, dtype=torch.float32, device=q.device)
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
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.size(1),
        BLOCK_N=block_n, NUM_SPLITS=splits, SCALED=kv_scales is not None,
        num_warps=num_warps or (4 if kv_scales is None else 2), num_stages=num_stages, **pdl_args(q.device))
    if splits > 1:
        # one program per KV head merges its query heads' partials, 32 // heads splits per step
        merge_g = triton.next_power_of_2(group)
        chunk = min(splits, max(1, 32 // merge_g))
        reduce_splits_kernel[(num_seqs, num_kv_heads)](out, acc, ml, context_lens, out.stride(0), out.stride(1),
                                                       GROUP=group, MERGE_G=merge_g, HEAD_DIM=head_dim,
                                                       NUM_SPLITS=splits, SPLIT_CHUNK=chunk, BLOCK_N=block_n,
                                                       **pdl_args(q.device))
    return out


class TritonBackend(AttentionBackend):
    """The Triton kernels. Decode: split-KV attention that also norms and rotates q and k and stores
    k, v (with a float8 cache up to FUSED_FP8_MAX_SEQS sequences; past that, qk_norm_rope_kernel
    first). Prefill: one kernel norms, rotates and stores k and stores v, then paged prefill
    attention norms and rotates its q tiles; a mixed step's decoding sequences, from
    DECODE_PROGRAMS_FROM of them, get decode programs in its grid.
    A float8 cache's prefill step first dequantizes the blocks its q tiles read into the staging
    area (when they fit), and the q tiles read those as a model-dtype cache: converting float8
    tiles inside the kernel runs it at half its bf16 speed (H100, 16 x 1024 tokens of Qwen3-0.6B:
    bf16 197 us, float8 converted inside 388, of which 110 the conversion and 80 the scales'
    loads; the dequantization moves 101 MB in 42 us. NOTES.md, 2026-11-26, seventeenth session).
    The values are the float8 cache's, rounded once to the model dtype.
    On Hopper with a model-dtype cache, prefill attention is gluon_prefill's persistent kernel
    instead (where its shapes allow: see gluon_usable), over a work list built on the host."""
    name = "triton"
    supports_cuda_graphs = True  # launch shapes depend only on the batch size
    stages_float8_prefill = True

    def forward(self, layer, q, k, v, meta):
        if meta.is_decode:
            return self._decode(layer, q, k, v, meta)
        i, d = layer.layer_idx, self._num_decode_programs(meta.num_decodes)
        q_weight, k_weight, eps = self._qk_norm(layer)
        rope_store_kv(meta.positions, k, layer.rotary_emb.cos_sin_cache, k_weight, eps,
                      (v, self.k_caches[i], self.v_caches[i], self.k_scales[i], self.v_scales[i], meta.slot_mapping))
        if meta.work is not None and (q.size(1) // k.size(1)) % 2 == 0:
            from nanovllm.layers.attention import gluon_prefill
            return gluon_prefill.prefill_attention(q, self.k_caches[i], self.v_caches[i], meta.cu_seqlens_q,
                                                   meta.context_lens, meta.block_tables, meta.work, layer.scale,
                                                   new_q=(layer.rotary_emb.cos_sin_cache, q_weight, eps))
        tables, tile_kv = meta.block_tables, None
        if meta.staged is not None:
            blocks, tables = meta.staged
            tile_kv = dequantize_blocks(self.k_caches[i], self.v_caches[i], self._scales(i), blocks, self.staging)
        return prefill_attention(q, self.k_caches[i], self.v_caches[i], meta.cu_seqlens_q, meta.context_lens,
                                 tables, meta.max_seqlen_q, layer.scale, kv_scales=self._scales(i),
                                 new_q=(layer.rotary_emb.cos_sin_cache, q_weight, eps), num_decodes=d,
                                 tile_kv=tile_kv)

    def gluon_usable(self) -> bool:
        """Whether prefill steps take gluon_prefill's kernel: an H100-class GPU (compute capability
        9.0: wgmma and TMA as that kernel uses them), a bf16/fp16 cache of head_dim 128 whose blocks
        hold whole 128-token tiles. Per layer, forward also needs an even number of query heads per
        KV head."""
        c = self.k_caches[0] if self.k_caches else None
        if c is None or not c.is_cuda or torch.cuda.get_device_capability(c.device) != (9, 0):
            return False
        from nanovllm.layers.attention import gluon_prefill
        return (c.dtype in (torch.bfloat16, torch.float16) and c.size(3) == gluon_prefill.HEAD_DIM
                and c.size(1) % gluon_prefill.BLOCK_N == 0 and c.is_contiguous())

    def host_arrays(self, plan) -> dict:
        """A prefill step: gluon_prefill's work list (prefill_work) where gluon_usable; a float8
        cache's: the blocks its q tiles read (staged_blocks) and the block tables renumbered into
        the staging area (staged_tables), when they fit there (staging_plan)."""
        if plan.is_decode:
            return {}
        if self.gluon_prefill:
            from nanovllm.layers.attention.gluon_prefill import work_list
            return {"prefill_work": work_list(np.diff(plan.cu_seqlens_q))}
        if self.staging is None:
            return {}
        staged = staging_plan(plan.block_tables, plan.context_lens, self._num_decode_programs(plan.num_decodes),
                              self.staging.size(2), self.staging.size(1))
        return {} if staged is None else dict(zip(("staged_blocks", "staged_tables"), staged))

    def build_metadata(self, plan, tensors):
        meta = super().build_metadata(plan, tensors)
        if "staged_blocks" in tensors:
            meta.staged = tensors["staged_blocks"], tensors["staged_tables"]
        meta.work = tensors.get("prefill_work")
        return meta

    def bind_kv_cache(self, kv_cache):
        super().bind_kv_cache(kv_cache)
        self.gluon_prefill = self.gluon_usable()

    @staticmethod
    def _num_decode_programs(num_decodes: int) -> int:
        """A mixed step's leading decoding sequences that get decode programs (the rest: q tiles)."""
        return num_decodes if num_decodes >= DECODE_PROGRAMS_FROM else 0

    def _decode(self, layer, q, k, v, meta):
        """Decode attention of q [num_seqs, num_heads, head_dim] (one new token per sequence, not yet
        normed or rotated, its k and v not yet stored)."""
        i = layer.layer_idx
        cos_sin, scales = layer.rotary_emb.cos_sin_cache, self._scales(i)
        q_weight, k_weight, eps = self._qk_norm(layer)
        if scales is None or q.size(0) <= FUSED_FP8_MAX_SEQS:
            # the norms, rotation and K/V store inside the attention kernel: one kernel fewer per layer
            # (H100: decode graph of 1 sequence 930 -> 880 us, of 8 1360 -> 1247).
            return decode_attention(q, self.k_caches[i], self.v_caches[i], meta.context_lens, meta.block_tables,
                                    layer.scale, kv_scales=scales,
                                    new_token=(k, v, meta.positions, cos_sin, q_weight, k_weight, eps,
                                               meta.slot_mapping))
        qk_norm_rope(meta.positions, q, k, cos_sin, q_weight, k_weight, eps,
                     kv_cache=(v, self.k_caches[i], self.v_caches[i], *scales, meta.slot_mapping))
        return decode_attention(q, self.k_caches[i], self.v_caches[i], meta.context_lens, meta.block_tables,
                                layer.scale, kv_scales=scales)

    def _scales(self, i: int) -> tuple | None:
        return None if self.k_scales[i] is None else (self.k_scales[i], self.v_scales[i])

    @staticmethod
    def _qk_norm(layer) -> tuple:
        """(q_norm weight, k_norm weight, eps) of a Qwen3 layer, else (None, None, 0.0)."""
        norms = layer.qk_norms
        return (norms[0].weight, norms[1].weight, norms[0].eps) if norms else (None, None, 0.0)
