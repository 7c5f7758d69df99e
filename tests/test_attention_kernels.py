"""Triton paged-attention kernels against a float32 torch reference, on random inputs of awkward sizes.

On CUDA every case runs at realistic sizes; without CUDA the kernels run in Triton's
interpreter (TRITON_INTERPRET=1, set in conftest) on a few tiny cases.
"""
import pytest
import torch

pytest.importorskip("triton")
from nanovllm.layers.attention.base import AttentionMetadata  # noqa: E402
from nanovllm.layers.fp8 import quantize_fp8  # noqa: E402
from nanovllm.layers.attention.torch_backend import paged_attention_reference  # noqa: E402
from nanovllm.layers.attention.triton_backend import decode_attention, prefill_attention  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# relative error ||out - ref|| / ||ref|| allowed per dtype: P is rounded to the dtype before P @ V
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def rel_err(out, ref):
    assert not out.isnan().any(), "kernel left unwritten (NaN-poisoned) outputs"
    return ((out.float() - ref).norm() / ref.norm()).item()


def make_cache(context_lens, block_size, num_kv_heads, head_dim, dtype, gen, fp8=False):
    """Random paged caches with each sequence's blocks scattered over the pool; returns (k, v,
    block_tables, kv_scales): with fp8, k and v in float8 e4m3 with kv_scales (k_scales, v_scales)
    of magnitudes that vary by token, else kv_scales None."""
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
    if not fp8:
        return k, v, tables.to(DEVICE), None
    magnitudes = torch.rand(shape[:3] + (1,), generator=gen).to(DEVICE) * 4 + 0.01
    (k, k_scales), (v, v_scales) = (quantize_fp8((x * magnitudes).view(-1, *shape[2:]), torch.float8_e4m3fn)
                                    for x in (k, v))
    return k.view(shape), v.view(shape), tables.to(DEVICE), (k_scales.view(shape[:3]), v_scales.view(shape[:3]))


def reference(q, k, v, cu_q, context_lens, tables, scale, kv_scales=None):
    meta = AttentionMetadata(None, None, cu_q, context_lens, tables, 0, False)
    return paged_attention_reference(q.float(), k.float(), v.float(), meta, scale, *(kv_scales or ())).float()


GPU_CASES = [(dtype, bs, group, hd) for dtype in (torch.bfloat16, torch.float16) for bs in (16, 256)
             for group in (1, 2, 8) for hd in (64, 128)]
CPU_CASES = [(torch.float32, 16, 2, 16), (torch.float16, 4, 1, 32), (torch.float32, 8, 4, 16)]
CASES = GPU_CASES if CUDA else CPU_CASES


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype,block_size,group,head_dim", CASES)
def test_prefill_kernel(dtype, block_size, group, head_dim, fp8):
    gen = torch.Generator().manual_seed(hash((block_size, group, head_dim)) % 2**31)
    num_kv_heads = 2
    # (cached prefix, new tokens) per sequence: plain prefill, prefix hits, chunks, single decode tokens
    shapes = [(0, 77), (130, 35), (0, 1), (300, 1), (17, 200)] if CUDA else [(0, 11), (9, 5), (0, 1), (20, 3)]
    context_lens = [p + n for p, n in shapes]
    k, v, tables, kv_scales = make_cache(context_lens, block_size, num_kv_heads, head_dim, dtype, gen, fp8)
    counts = torch.tensor([n for _, n in shapes])
    cu_q = torch.zeros(len(shapes) + 1, dtype=torch.int32)
    cu_q[1:] = counts.cumsum(0)
    q = torch.randn(int(cu_q[-1]), num_kv_heads * group, head_dim, generator=gen).to(DEVICE, dtype)
    cu_q, lens = cu_q.to(DEVICE), torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    ref = reference(q, k, v, cu_q, lens, tables, scale, kv_scales)
    for block_m, block_n in ((64, 64), (16, 16)):  # 16: block-aligned tiles
        out = torch.full_like(q, float("nan"))
        prefill_attention(q, k, v, cu_q, lens, tables, int(counts.max()), scale, out=out, kv_scales=kv_scales,
                          block_m=block_m, block_n=block_n)
        assert rel_err(out, ref) < TOL[dtype], f"block_m={block_m}, block_n={block_n}"


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype,block_size,group,head_dim", CASES)
@pytest.mark.parametrize("num_seqs", [1, 5, 64] if CUDA else [3])
def test_decode_kernel(dtype, block_size, group, head_dim, num_seqs, fp8):
    gen = torch.Generator().manual_seed(num_seqs * 7 + group)
    num_kv_heads = 2 if group == 8 else 4
    max_len = 1500 if CUDA else 40
    context_lens = torch.randint(1, max_len, (num_seqs,), generator=gen).tolist()
    context_lens[0] = max_len - 1  # a long one, not a multiple of the block size
    k, v, tables, kv_scales = make_cache(context_lens, block_size, num_kv_heads, head_dim, dtype, gen, fp8)
    q = torch.randn(num_seqs, num_kv_heads * group, head_dim, generator=gen).to(DEVICE, dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    cu_q = torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    ref = reference(q, k, v, cu_q, lens, tables, scale, kv_scales)
    for splits, block_n in ((None, 64), (1, 64), (4, 128), (16, 64), (2, 128), (1, 16), (4, 16)):  # 16: block-aligned tiles
        out = torch.full_like(q, float("nan"))
        decode_attention(q, k, v, lens, tables, scale, num_splits=splits, out=out, block_n=block_n, kv_scales=kv_scales)
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
