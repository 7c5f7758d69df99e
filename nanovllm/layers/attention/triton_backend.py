"""Our own paged-attention backend: the Triton kernels of nanovllm/kernels (prefill_attention.py,
decode_attention.py, gluon_prefill.py and qk_norm_rope.py)."""
import numpy as np
import torch

from nanovllm.layers.attention.base import AttentionBackend
from nanovllm.kernels.decode_attention import MAX_QUERY_ROWS, decode_attention
from nanovllm.kernels.prefill_attention import dequantize_blocks, prefill_attention, staging_plan
from nanovllm.kernels.qk_norm_rope import qk_norm_rope, rope_store_kv

# A mixed step's first sequences with one new token each (the decoding ones) get decode programs in
# prefill attention's grid from this many on; below, 64-row q tiles like the others (H100, a step of
# 16,384 tokens, decoding contexts 1000-2000, us per layer, q tiles -> decode programs: bf16 8 of them
# 332.4 -> 337.8, 16 369.8 -> 366.6, 32 426.7 -> 386.3, 200 877.4 -> 638.0; float8 8 610.8 -> 593.5,
# 200 1424.0 -> 868.5; docs/perf-log.md, 2026-11-26).
DECODE_PROGRAMS_FROM = 16
# A float8 cache's decode steps store the new token inside the attention kernel up to this many
# sequences; beyond, every split program's float8 store and q rotation cost more than the kernel
# they save (H100, Qwen3-0.6B, graph us separate -> fused: 1 sequence 902 -> 858, 8 1193 -> 1141,
# 16 1325 -> 1314, 32 1673 -> 1720, 256 5590 -> 5808; docs/perf-log.md, 2026-11-25).
FUSED_FP8_MAX_SEQS = 16


class TritonBackend(AttentionBackend):
    """The Triton kernels. Decode: split-KV attention that also norms and rotates q and k and stores
    k, v (with a float8 cache up to FUSED_FP8_MAX_SEQS sequences; past that, qk_norm_rope
    first). Prefill: one kernel norms, rotates and stores k and stores v, then paged prefill
    attention norms and rotates its q tiles; a mixed step's decoding sequences, from
    DECODE_PROGRAMS_FROM of them, get decode programs in its grid. A step of q_len > 1 new tokens
    per sequence (verifying drafts) takes qk_norm_rope and the decode kernel, whose programs take
    the q_len tokens of a sequence together over its keys, split as a decode step's, where q_len
    x the query heads per KV head fit its tile (MAX_QUERY_ROWS); else the prefill path, whose q
    tiles read the whole context per query head with q_len of their 64 rows in use (one sequence
    of 5 tokens and 1100 of context, H200: 19.9 -> 10.7 us with Qwen3-0.6B's heads, 22.8 -> 10.8
    with Qwen3-8B's: docs/perf-log.md, 2026-11-28; benchmarks/decode_attention.py --q-len times it). Either
    grid is fixed for a fixed (batch size, q_len), so such steps replay CUDA graphs too (without
    gluon_prefill's work list or a float8 cache's staging, which are planned on the host per step).
    A float8 cache's prefill step first dequantizes the blocks its q tiles read into the staging
    area (when they fit), and the q tiles read those as a model-dtype cache: converting float8
    tiles inside the kernel runs it at half its bf16 speed (H100, 16 x 1024 tokens of Qwen3-0.6B:
    bf16 197 us, float8 converted inside 388, of which 110 the conversion and 80 the scales'
    loads; the dequantization moves 101 MB in 42 us. docs/perf-log.md, 2026-11-26).
    The values are the float8 cache's, rounded once to the model dtype.
    On Hopper with a model-dtype cache, prefill attention is gluon_prefill's persistent kernel
    instead (where its shapes allow: see gluon_usable), over a work list built on the host."""
    name = "triton"
    supports_cuda_graphs = True  # launch shapes depend only on (batch size, uniform_q_len)
    stages_float8_prefill = True

    def forward(self, layer, q, k, v, meta):
        if meta.is_decode:
            return self._decode(layer, q, k, v, meta)
        q_len = meta.uniform_q_len
        if q_len is not None and q_len * (q.size(1) // k.size(1)) <= MAX_QUERY_ROWS:
            return self._uniform(layer, q, k, v, meta)
        i, d = layer.layer_idx, self._num_decode_programs(meta.num_decodes)
        q_weight, k_weight, eps = self._qk_norm(layer)
        rope_store_kv(meta.positions, k, layer.rotary_emb.cos_sin_cache, k_weight, eps,
                      (v, self.k_caches[i], self.v_caches[i], self.k_scales[i], self.v_scales[i], meta.slot_mapping))
        if meta.work is not None and (q.size(1) // k.size(1)) % 2 == 0:
            from nanovllm.kernels import gluon_prefill
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
        from nanovllm.kernels import gluon_prefill
        return (c.dtype in (torch.bfloat16, torch.float16) and c.size(3) == gluon_prefill.HEAD_DIM
                and c.size(1) % gluon_prefill.BLOCK_N == 0 and c.is_contiguous())

    def host_arrays(self, plan, graphed: bool = False) -> dict:
        """A prefill step that runs eagerly: gluon_prefill's work list (prefill_work) where
        gluon_usable; a float8 cache's: the blocks its q tiles read (staged_blocks) and the block
        tables renumbered into the staging area (staged_tables), when they fit there
        (staging_plan). A step that replays a graph (decode, verify runs) reads neither, and the
        work list cost a verify step ~36 us of host time on an H100 (docs/perf-log.md, 2026-11-28)."""
        if plan.is_decode or graphed:
            return {}
        if self.gluon_prefill:
            from nanovllm.kernels.gluon_prefill import work_list
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

    def _uniform(self, layer, q, k, v, meta):
        """Attention of q [num_seqs * q_len, num_heads, head_dim], q_len new tokens per sequence (not
        yet normed or rotated, their k and v not yet stored): qk_norm_rope, then the decode kernel."""
        i = layer.layer_idx
        q_weight, k_weight, eps = self._qk_norm(layer)
        qk_norm_rope(meta.positions, q, k, layer.rotary_emb.cos_sin_cache, q_weight, k_weight, eps,
                     kv_cache=(v, self.k_caches[i], self.v_caches[i], self.k_scales[i], self.v_scales[i],
                               meta.slot_mapping))
        return decode_attention(q, self.k_caches[i], self.v_caches[i], meta.context_lens, meta.block_tables,
                                layer.scale, kv_scales=self._scales(i), q_len=meta.uniform_q_len)

    def _scales(self, i: int) -> tuple | None:
        return None if self.k_scales[i] is None else (self.k_scales[i], self.v_scales[i])

    @staticmethod
    def _qk_norm(layer) -> tuple:
        """(q_norm weight, k_norm weight, eps) of a Qwen3 layer, else (None, None, 0.0)."""
        norms = layer.qk_norms
        return (norms[0].weight, norms[1].weight, norms[0].eps) if norms else (None, None, 0.0)
