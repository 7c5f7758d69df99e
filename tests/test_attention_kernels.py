"""Triton paged-attention kernels against a float32 torch reference, on random inputs of awkward sizes.

On CUDA every case runs at realistic sizes; without CUDA the kernels run in Triton's
interpreter (TRITON_INTERPRET=1, set in conftest) on a few tiny cases.
"""
import numpy as np
import pytest
import torch

pytest.importorskip("triton")
from nanovllm.layers.attention.base import AttentionMetadata  # noqa: E402
from nanovllm.kernels.fp8 import quantize_fp8  # noqa: E402
from nanovllm.layers.attention.torch_backend import paged_attention_reference  # noqa: E402
from nanovllm.kernels.decode_attention import decode_attention  # noqa: E402
from nanovllm.kernels.prefill_attention import dequantize_blocks, prefill_attention, staging_plan  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# relative error ||out - ref|| / ||ref|| allowed per dtype: P is rounded to the dtype before P @ V
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def rel_err(out, ref):
    assert not out.isnan().any(), "kernel left unwritten (NaN-poisoned) outputs"
    return ((out.float() - ref).norm() / ref.norm()).item()


def make_cache(context_lens, block_size, num_kv_heads, head_dim, dtype, gen, fp8=False):
    """Random paged caches with each sequence's blocks scattered over the pool, NaN in every slot
    past a context (kernels must not let them reach the output); returns (k, v, block_tables,
    kv_scales): with fp8, k and v in float8 e4m3 with kv_scales (k_scales, v_scales) of
    magnitudes that vary by token, else kv_scales None."""
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(context_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    v = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    stale = torch.ones(num_blocks * block_size, dtype=torch.bool)
    for i, n in enumerate(context_lens):
        slots = tables[i, :blocks_per_seq[i]].long()[:, None] * block_size + torch.arange(block_size)
        stale[slots.flatten()[:n]] = False
    stale = stale.to(DEVICE)
    if not fp8:
        for x in (k, v):
            x.view(-1, num_kv_heads, head_dim)[stale] = float("nan")
        return k, v, tables.to(DEVICE), None
    magnitudes = torch.rand(shape[:3] + (1,), generator=gen).to(DEVICE) * 4 + 0.01
    (k, k_scales), (v, v_scales) = (quantize_fp8((x * magnitudes).view(-1, *shape[2:]), torch.float8_e4m3fn)
                                    for x in (k, v))
    for x in (k, v):  # float8 e4m3's NaN is 0x7f
        x.view(torch.uint8).view(num_blocks * block_size, -1)[stale] = 0x7F
    for x in (k_scales, v_scales):
        x.view(num_blocks * block_size, -1)[stale] = float("nan")
    return k.view(shape), v.view(shape), tables.to(DEVICE), (k_scales.view(shape[:3]), v_scales.view(shape[:3]))


def reference(q, k, v, cu_q, context_lens, tables, scale, kv_scales=None):
    meta = AttentionMetadata(None, None, cu_q, context_lens, tables, 0, False)
    return paged_attention_reference(q.float(), k.float(), v.float(), meta, scale, *(kv_scales or ())).float()


GPU_CASES = [(dtype, bs, group, hd) for dtype in (torch.bfloat16, torch.float16) for bs in (16, 256)
             for group in (1, 2, 8) for hd in (64, 128)]
CPU_CASES = [(torch.float32, 16, 2, 16), (torch.float16, 4, 1, 32), (torch.float32, 32, 4, 16)]
CASES = GPU_CASES if CUDA else CPU_CASES


# (cached prefix, new tokens) per sequence: plain prefill, prefix hits, chunks, single decode tokens
PREFILL_SHAPES = [(0, 77), (130, 35), (0, 1), (300, 1), (17, 200)] if CUDA else [(0, 11), (9, 5), (0, 1), (40, 3)]
# a mixed step's decoding sequences, which the scheduler puts first (prefill_attention's num_decodes)
DECODE_SHAPES = [(700, 1), (0, 1), (64, 1)] if CUDA else [(40, 1), (0, 1), (16, 1)]


def prefill_batch(dtype, block_size, group, head_dim, fp8, gen, num_decodes=0):
    """A step of the first num_decodes DECODE_SHAPES, then PREFILL_SHAPES, over 2 KV heads: q [T, 2 *
    group, head_dim], the caches (make_cache's k, v, block_tables, kv_scales), cu_seqlens_q,
    context_lens and the tokens' positions [T]."""
    shapes = DECODE_SHAPES[:num_decodes] + PREFILL_SHAPES
    context_lens = [p + n for p, n in shapes]
    k, v, tables, kv_scales = make_cache(context_lens, block_size, 2, head_dim, dtype, gen, fp8)
    cu_q = torch.zeros(len(shapes) + 1, dtype=torch.int32)
    cu_q[1:] = torch.tensor([n for _, n in shapes]).cumsum(0)
    q = torch.randn(int(cu_q[-1]), 2 * group, head_dim, generator=gen).to(DEVICE, dtype)
    positions = torch.cat([torch.arange(p, p + n) for p, n in shapes]).to(DEVICE)
    return (q, k, v, tables, kv_scales, cu_q.to(DEVICE), torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
            positions)


def check_prefill(q, ref, k, v, tables, kv_scales, cu_q, lens, **kwargs):
    """prefill_attention at two tilings into NaN-poisoned outputs, against ref: 16-wide tiles lie
    inside a block, 64-wide ones only in blocks of 64 or more (else each row is gathered)."""
    max_q = max(n for _, n in PREFILL_SHAPES)
    for block_m, block_n in ((64, 64), (16, 16)):
        out = torch.full_like(q, float("nan"))
        prefill_attention(q, k, v, cu_q, lens, tables, max_q, q.size(2) ** -0.5, out=out, kv_scales=kv_scales,
                          block_m=block_m, block_n=block_n, **kwargs)
        assert rel_err(out, ref) < TOL[q.dtype], f"block_m={block_m}, block_n={block_n}"


@pytest.mark.parametrize("tma,num_decodes", [(True, 0), (False, 0), (True, 3)])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype,block_size,group,head_dim", CASES)
def test_prefill_kernel(dtype, block_size, group, head_dim, fp8, tma, num_decodes):
    """Block-aligned tiles through tensor descriptors (TMA) or pointers give the same attention; so
    do a mixed step's leading decoding sequences as decode programs (num_decodes)."""
    gen = torch.Generator().manual_seed(hash((block_size, group, head_dim)) % 2**31)
    q, k, v, tables, kv_scales, cu_q, lens, _ = prefill_batch(dtype, block_size, group, head_dim, fp8, gen,
                                                              num_decodes)
    ref = reference(q, k, v, cu_q, lens, tables, head_dim ** -0.5, kv_scales)
    check_prefill(q, ref, k, v, tables, kv_scales, cu_q, lens, tma=tma, num_decodes=num_decodes)


@pytest.mark.parametrize("num_decodes", [0, 3])
@pytest.mark.parametrize("dtype,block_size,group,head_dim", CASES)
def test_prefill_kernel_reads_staged_float8_blocks(dtype, block_size, group, head_dim, num_decodes):
    """A float8 cache's blocks dequantized into a model-dtype staging area, as the Triton backend
    stages a prefill step (each block its q tiles read, once; decode programs read the cache):
    the staging holds value x scale rounded once to the dtype, and the attention over it is the
    float32 attention over the float8 cache within the dtype's tolerance."""
    gen = torch.Generator().manual_seed(hash((block_size, group, head_dim, num_decodes)) % 2**31)
    q, k, v, tables, kv_scales, cu_q, lens, _ = prefill_batch(dtype, block_size, group, head_dim, True, gen,
                                                              num_decodes)
    ref = reference(q, k, v, cu_q, lens, tables, head_dim ** -0.5, kv_scales)
    blocks, staged = staging_plan(tables.cpu().numpy().astype(np.int64), lens.cpu().numpy(), num_decodes, block_size,
                                  capacity=k.size(0))
    staging = torch.full((2, blocks.size + 2, *k.shape[1:]), float("nan"), dtype=dtype, device=DEVICE)
    tile_kv = dequantize_blocks(k, v, kv_scales, torch.from_numpy(blocks).to(DEVICE, torch.int32), staging)
    index = torch.from_numpy(blocks).to(DEVICE)
    for x, scales, out in zip((k, v), kv_scales, tile_kv):
        torch.testing.assert_close(out[:blocks.size], (x[index].float() * scales[index][..., None]).to(dtype),
                                   rtol=0, atol=0, equal_nan=True)  # stale slots are NaN in both
    check_prefill(q, ref, k, v, torch.from_numpy(staged).to(DEVICE, torch.int32), kv_scales, cu_q, lens,
                  num_decodes=num_decodes, tile_kv=tile_kv)


def test_staging_plan_takes_each_block_once():
    """Rows from first_seq on: the blocks their contexts use, each once in block order, and those
    entries renumbered into that list; earlier rows and unused entries as they were. More blocks
    than the capacity: None."""
    tables = np.array([[7, 2, -1], [4, 5, 6], [4, 9, -1], [3, 1, 8]])
    context_lens = np.array([5, 9, 8, 4])  # blocks of 4 tokens: 2, 3, 2 and 1 used
    blocks, staged = staging_plan(tables, context_lens, 1, 4, capacity=5)
    assert blocks.tolist() == [3, 4, 5, 6, 9]
    assert staged.tolist() == [[7, 2, -1], [1, 2, 3], [1, 4, -1], [0, 1, 8]]
    assert staging_plan(tables, context_lens, 1, 4, capacity=4) is None


class _RopeCfg:
    rope_theta = 1e6


@pytest.mark.parametrize("num_decodes", [0, 3])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype,block_size,group,head_dim", CASES[:4])
def test_prefill_kernel_rotates_q_inside(dtype, block_size, group, head_dim, norm, fp8, num_decodes):
    """new_q: the kernel norms and rotates its q tiles (and decode programs their heads) at each
    query's position (its index in the sequence); the output must be the float32 attention with
    qk_norm_rope's q, and q not written."""
    from nanovllm.kernels.qk_norm_rope import qk_norm_rope
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    gen = torch.Generator().manual_seed(group * head_dim + 2 * norm + fp8)
    q, k, v, tables, kv_scales, cu_q, lens, positions = prefill_batch(dtype, block_size, group, head_dim, fp8, gen,
                                                                      num_decodes)
    rope = RotaryEmbedding(_RopeCfg(), head_dim, 4096).to(DEVICE)
    weights = tuple(torch.randn(head_dim, generator=gen).to(DEVICE, dtype) for _ in range(2)) if norm else (None, None)
    q_ref = q.clone()
    qk_norm_rope(positions, q_ref, torch.zeros_like(q_ref[:, :2]), rope.cos_sin_cache, *weights, 1e-6)
    ref = reference(q_ref, k, v, cu_q, lens, tables, head_dim ** -0.5, kv_scales)
    q_before = q.clone()
    check_prefill(q, ref, k, v, tables, kv_scales, cu_q, lens, new_q=(rope.cos_sin_cache, weights[0], 1e-6),
                  num_decodes=num_decodes)
    assert torch.equal(q, q_before)


HOPPER = CUDA and torch.cuda.get_device_capability() == (9, 0)


def test_gluon_work_list():
    """Each prefilling sequence's 64-row q tiles from the last down, sequences in order; each
    decoding one (one new token, anywhere in the step) once as (sequence, -1), spread among them."""
    from nanovllm.kernels.gluon_prefill import work_list
    assert work_list(np.array([1, 300, 1, 64, 65, 1])).tolist() == [
        [0, -1], [1, 4], [1, 3], [1, 2], [2, -1], [1, 1], [1, 0], [3, 0], [5, -1], [4, 1], [4, 0]]
    assert work_list(np.array([1, 1])).tolist() == [[0, -1], [1, -1]]
    assert work_list(np.array([128])).tolist() == [[0, 1], [0, 0]]
    q_lens = np.random.default_rng(0).integers(1, 400, 50)
    entries = work_list(q_lens)
    expected = [(s, -1) if n == 1 else (s, m) for s, n in enumerate(q_lens)
                for m in range(1 if n == 1 else -(-n // 64))]
    assert sorted(map(tuple, entries.tolist())) == sorted(expected)


@pytest.mark.skipif(not HOPPER, reason="gluon_prefill's kernel needs an H100-class GPU (compute capability 9.0)")
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype,block_size,group", [(torch.bfloat16, 256, 2), (torch.float16, 128, 4),
                                                    (torch.bfloat16, 256, 8)])
def test_gluon_prefill_kernel(dtype, block_size, group, norm):
    """gluon_prefill.prefill_attention on a mixed step (decoding sequences first and among the
    prompts, contexts of 1 to 3001, prefix hits, tiles past a block, whole and partial q tiles),
    q a strided view of a packed qkv as the model passes it: the float32 attention of
    qk_norm_rope's q, into a NaN-poisoned output, and q not written."""
    from nanovllm.kernels import gluon_prefill
    from nanovllm.kernels.qk_norm_rope import qk_norm_rope
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    gen = torch.Generator().manual_seed(group + 3 * norm)
    shapes = [(700, 1), (0, 1), (3000, 1), (64, 1), (0, 77), (130, 35), (2000, 1000), (0, 1), (17, 200), (127, 1),
              (0, 64), (5, 129)]
    kv_heads, head_dim = 2, 128
    context_lens = [p + n for p, n in shapes]
    k, v, tables, _ = make_cache(context_lens, block_size, kv_heads, head_dim, dtype, gen)
    cu_q = torch.zeros(len(shapes) + 1, dtype=torch.int32)
    cu_q[1:] = torch.tensor([n for _, n in shapes]).cumsum(0)
    T, H = int(cu_q[-1]), kv_heads * group
    qkv = torch.randn(T, H + 2 * kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q = qkv[:, :H]
    positions = torch.cat([torch.arange(p, p + n) for p, n in shapes]).to(DEVICE)
    rope = RotaryEmbedding(_RopeCfg(), head_dim, 4096).to(DEVICE)
    weights = tuple(torch.randn(head_dim, generator=gen).to(DEVICE, dtype) for _ in range(2)) if norm else (None, None)
    q_ref = q.clone()
    qk_norm_rope(positions, q_ref, torch.zeros_like(q_ref[:, :2]), rope.cos_sin_cache, *weights, 1e-6)
    cu_q, lens = cu_q.to(DEVICE), torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    ref = reference(q_ref, k, v, cu_q, lens, tables, head_dim ** -0.5)
    entries = torch.from_numpy(gluon_prefill.work_list(np.diff(cu_q.cpu().numpy()))).to(DEVICE)
    q_before = q.clone()
    out = torch.full((T, H, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    gluon_prefill.prefill_attention(q, k, v, cu_q, lens, tables, entries, head_dim ** -0.5,
                                    new_q=(rope.cos_sin_cache, weights[0], 1e-6), out=out)
    assert rel_err(out, ref) < TOL[dtype]
    assert torch.equal(q, q_before)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype,block_size,group,head_dim", CASES)
@pytest.mark.parametrize("num_seqs,q_len", [(1, 1), (5, 1), (64, 1), (1, 5), (7, 3)] if CUDA else [(3, 1), (2, 3)])
def test_decode_kernel(dtype, block_size, group, head_dim, num_seqs, q_len, fp8, monkeypatch):
    """Each sequence's last q_len tokens (q_len > 1: a verify run's), causally, at several splits
    and tile widths, into NaN-poisoned outputs."""
    empty = torch.empty  # the split partials start as NaN: splits without keys are never written nor read
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan"))
                        if kw.get("dtype") == torch.float32 else empty(*a, **kw))
    gen = torch.Generator().manual_seed(num_seqs * 7 + group + q_len)
    num_kv_heads = 2 if group == 8 else 4
    max_len = 1500 if CUDA else 40
    context_lens = torch.randint(q_len, max_len, (num_seqs,), generator=gen).tolist()
    context_lens[0] = max_len - 1  # a long one, not a multiple of the block size
    if num_seqs > 1 and q_len > 1:
        context_lens[1] = q_len  # only its own tokens
    k, v, tables, kv_scales = make_cache(context_lens, block_size, num_kv_heads, head_dim, dtype, gen, fp8)
    q = torch.randn(num_seqs * q_len, num_kv_heads * group, head_dim, generator=gen).to(DEVICE, dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    cu_q = torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    ref = reference(q, k, v, cu_q, lens, tables, scale, kv_scales)
    for splits, block_n in ((None, 64), (1, 64), (4, 128), (16, 64), (2, 128), (1, 16), (4, 16)):  # 16: block-aligned tiles
        out = torch.full_like(q, float("nan"))
        decode_attention(q, k, v, lens, tables, scale, num_splits=splits, out=out, block_n=block_n, kv_scales=kv_scales,
                         q_len=q_len)
        assert rel_err(out, ref) < TOL[dtype], f"num_splits={splits}, block_n={block_n}"


def test_decode_kernel_zero_length_rows_give_zeros():
    """Padding rows of a CUDA-graph batch have context length 0 and must not produce NaN."""
    gen = torch.Generator().manual_seed(3)
    k, v, tables, _ = make_cache([5, 1], 16, 2, 16, torch.float32, gen)
    q = torch.randn(2, 4, 16, generator=gen).to(DEVICE)
    lens = torch.tensor([5, 0], dtype=torch.int32, device=DEVICE)
    for splits in (1, 4):
        out = decode_attention(q, k, v, lens, tables, 0.25, num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1])) and not out.isnan().any()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype,block_size,group,head_dim", CASES[:4])
def test_decode_kernel_with_the_new_token_inside(dtype, block_size, group, head_dim, norm, fp8):
    """new_token: the kernel norms and rotates q and k and stores k, v itself; the cache must equal
    what qk_norm_rope stores (bit for bit) and the output the float32 attention over that cache
    with qk_norm_rope's q. Also a padding row (context 0, slot -1): zeros, nothing stored."""
    from nanovllm.kernels.qk_norm_rope import qk_norm_rope
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    gen = torch.Generator().manual_seed(group * head_dim + 2 * norm + fp8)
    num_kv_heads, max_len = 2, (1500 if CUDA else 40)
    context_lens = torch.randint(1, max_len, (4,), generator=gen).tolist() + [0]
    context_lens[0] = max_len - 1
    k_cache, v_cache, tables, kv_scales = make_cache(context_lens, block_size, num_kv_heads, head_dim, dtype, gen, fp8)
    n, heads = len(context_lens), num_kv_heads * group
    qkv = torch.randn(n, (heads + 2 * num_kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q, k, v = (x.view(n, -1, head_dim) for x in (q, k, v))
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    positions = (lens - 1).clamp(min=0).long()
    slots = torch.tensor([int(tables[i, (c - 1) // block_size]) * block_size + (c - 1) % block_size if c else -1
                          for i, c in enumerate(context_lens)], device=DEVICE)
    for cache in (k_cache, v_cache) + (kv_scales or ()):  # the new token's slots: NaN until written
        cache.view(-1, num_kv_heads, *cache.shape[3:])[slots[:-1]] = float("nan")
    rope = RotaryEmbedding(_RopeCfg(), head_dim, 4096).to(DEVICE)
    weights = tuple(torch.randn(head_dim, generator=gen).to(DEVICE, dtype) for _ in range(2)) if norm else (None, None)
    scale = head_dim ** -0.5
    caches = (k_cache, v_cache) + (kv_scales or (None, None))
    ref_caches = tuple(None if c is None else c.clone() for c in caches)
    q_ref, k_ref = q.clone(), k.clone()
    qk_norm_rope(positions, q_ref, k_ref, rope.cos_sin_cache, *weights, 1e-6, kv_cache=(v, *ref_caches, slots))
    ref = reference(q_ref, ref_caches[0], ref_caches[1], torch.arange(n + 1, dtype=torch.int32, device=DEVICE), lens,
                    tables, scale, None if kv_scales is None else ref_caches[2:])
    q_before, poisoned = q.clone(), tuple(None if c is None else c.clone() for c in caches)
    # 16-wide tiles: the token also in a split's later tile, and in the first tile of a later split
    for splits, block_n in ((None, 64), (1, 64), (4, 64), (1, 16), (4, 16)):
        for c, p in zip(caches, poisoned):
            if c is not None:
                c.copy_(p)
        out = torch.full_like(q, float("nan"))
        decode_attention(q, k_cache, v_cache, lens, tables, scale, num_splits=splits, out=out, kv_scales=kv_scales,
                         block_n=block_n, new_token=(k, v, positions, rope.cos_sin_cache, *weights, 1e-6, slots))
        assert rel_err(out[:-1], ref[:-1]) < TOL[dtype], f"num_splits={splits}, block_n={block_n}"
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))
        for ours, theirs in zip(caches, ref_caches):
            if ours is not None:
                a, b = ours.float().nan_to_num(7.0), theirs.float().nan_to_num(7.0)
                assert torch.equal(a, b), (int((a != b).sum()), a[a != b][:4].tolist(), b[a != b][:4].tolist())
        assert torch.equal(q, q_before)  # q is read, not rotated in place


def _uniform_meta(cached, q_len, tables, block_size):
    """AttentionMetadata of a step of q_len new tokens after each sequence's `cached` tokens."""
    positions = torch.cat([torch.arange(c, c + q_len) for c in cached]).to(DEVICE)
    seq_of_token = torch.arange(len(cached), device=DEVICE).repeat_interleave(q_len)
    slots = tables[seq_of_token, positions // block_size].long() * block_size + positions % block_size
    cu_q = torch.arange(0, (len(cached) + 1) * q_len, q_len, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(cached, dtype=torch.int32, device=DEVICE) + q_len
    return AttentionMetadata(positions, slots, cu_q, lens, tables, q_len, q_len, len(cached) if q_len == 1 else 0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("q_len", [2, 3])
def test_uniform_steps_of_several_tokens_through_the_backends(backend, q_len):
    """A step of q_len new tokens for every sequence (a verify run: its last token and q_len - 1
    drafts) through a backend's forward (rotary, K/V store, attention; the Triton backend's
    qk_norm_rope and decode kernel of q_len tokens a program): paged_attention_reference's attention over the cache as the step writes it, and the same
    tokens run one at a time as decode steps give the same rows."""
    from nanovllm.engine.kv_cache import KVCache
    from nanovllm.layers.attention import Attention, make_backend
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    dtype, block_size, kv_heads, group, head_dim = ((torch.bfloat16, 16, 2, 4, 128) if CUDA
                                                    else (torch.float32, 16, 2, 2, 16))
    gen = torch.Generator().manual_seed(q_len)
    cached = [5, 20, 0, 33] if not CUDA else [5, 700, 0, 1500, 64, 31]
    k_cache, v_cache, tables, _ = make_cache([c + q_len for c in cached], block_size, kv_heads, head_dim, dtype, gen)
    rope = RotaryEmbedding(_RopeCfg(), head_dim, 4096).to(DEVICE)
    num_tokens, heads = len(cached) * q_len, kv_heads * group
    q, k, v = (torch.randn(num_tokens, h * head_dim, generator=gen).to(DEVICE, dtype) for h in (heads, kv_heads, kv_heads))
    meta = _uniform_meta(cached, q_len, tables, block_size)

    def attention():  # the backend over its own copy of the cache
        impl = make_backend(backend)
        impl.bind_kv_cache(KVCache(torch.stack([k_cache, v_cache]).unsqueeze(1).clone(), None))
        return impl, Attention(heads, head_dim, kv_heads, 0, rope, None, impl)

    impl, layer = attention()
    out = layer(q.clone(), k.clone(), v.clone(), meta).view(num_tokens, heads, head_dim)
    q_ref, k_ref = rope(meta.positions, q.clone().view(num_tokens, heads, head_dim),
                        k.clone().view(num_tokens, kv_heads, head_dim))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    for cache, x in ((ref_k, k_ref), (ref_v, v.view(num_tokens, kv_heads, head_dim))):
        cache.view(-1, kv_heads, head_dim)[meta.slot_mapping] = x
    # K/V stored, K rotated (the Triton kernel rounds the rotation once, torch's rotary each product:
    # they may differ by the dtype's rounding); stale slots NaN in both
    for ours, theirs in ((impl.k_caches[0], ref_k), (impl.v_caches[0], ref_v)):
        torch.testing.assert_close(ours, theirs, rtol=TOL[dtype], atol=TOL[dtype], equal_nan=True)
    ref = paged_attention_reference(q_ref.float(), ref_k.float(), ref_v.float(), meta, head_dim ** -0.5)
    assert rel_err(out, ref) < TOL[dtype]
    impl, layer = attention()
    rows = torch.arange(len(cached), device=DEVICE) * q_len
    for i in range(q_len):  # token i of every sequence: one decode step
        one = layer(q[rows + i], k[rows + i], v[rows + i], _uniform_meta([c + i for c in cached], 1, tables, block_size))
        assert rel_err(one.view(-1, heads, head_dim), out[rows + i].float()) < TOL[dtype], i
