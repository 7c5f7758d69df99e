"""Decode attention alone: batch x context on Qwen3-0.6B's heads, K/V bytes read over kernel time,
as a fraction of the measured device-to-device copy bandwidth. --kv-cache-dtype fp8: float8 K/V
with their float32 scales (counted in the bytes). --q-len Q: a verify step's attention (Q new
tokens per sequence, e.g. --batch 1), the two ways the Triton backend can take it, as it runs
them: qk_norm_rope then the decode kernel, per split count, against rope_store_kv then the
prefill kernel (which norms and rotates q itself); both under a CUDA graph."""
import argparse
import itertools

import torch
from triton.testing import do_bench, do_bench_cudagraph

from bench import measure_bandwidth
from nanovllm.kernels.fp8 import quantize_fp8
from nanovllm.kernels.decode_attention import DECODE_BLOCK_N, decode_attention, decode_num_splits
from nanovllm.kernels.prefill_attention import prefill_attention
from nanovllm.kernels.qk_norm_rope import qk_norm_rope, rope_store_kv


def to_fp8(k, v):
    """(k, v, kv_scales) of bf16 caches [num_blocks, block_size, num_kv_heads, head_dim] in float8."""
    shape = k.shape
    (k, k_scales), (v, v_scales) = (quantize_fp8(x.view(-1, *shape[2:]), torch.float8_e4m3fn) for x in (k, v))
    return k.view(shape), v.view(shape), (k_scales.view(shape[:3]), v_scales.view(shape[:3]))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[256, 16])
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument("--varied", action="store_true", help="context lengths uniform in [100, 2 * context]; sweep splits")
    p.add_argument("--sweep", type=int, nargs="*", metavar="BATCH",
                   help="for these batch sizes (varied lengths, first block size): time every kernel configuration")
    p.add_argument("--q-len", type=int, help="time a verify step's attention of this many tokens per sequence")
    args = p.parse_args()
    if args.sweep:
        return sweep(args)
    if args.q_len:
        return verify(args)
    bandwidth = measure_bandwidth("cuda")
    for block_size in args.block_sizes:
        blocks_per_seq = -(-args.context // block_size)
        num_blocks = args.batch * blocks_per_seq
        shape = (num_blocks, block_size, args.num_kv_heads, args.head_dim)
        k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(args.batch, blocks_per_seq)
        lens = torch.full((args.batch,), args.context, dtype=torch.int32, device="cuda")
        if args.varied:
            # longest first, as the scheduler orders decode steps
            g = torch.Generator(device="cuda").manual_seed(args.batch)  # the same lengths in every run
            lens = torch.randint(100, 2 * args.context, (args.batch,), dtype=torch.int32, device="cuda",
                                 generator=g).sort(descending=True).values
            blocks_per_seq = -(-2 * args.context // block_size)
            num_blocks = args.batch * blocks_per_seq
            k = torch.randn((num_blocks, *shape[1:]), device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(args.batch, blocks_per_seq)
        q = torch.randn(args.batch, args.num_heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
        kv_scales, per_vector = None, args.head_dim * 2  # bytes of one token's K (or V) of one head
        if args.kv_cache_dtype == "fp8":
            (k, v, kv_scales), per_vector = to_fp8(k, v), args.head_dim + 4
        kv_bytes = 2 * int(lens.sum()) * args.num_kv_heads * per_vector
        for splits in ([None, 1, 2, 4, 8] if args.varied else [None]):
            seconds = do_bench(lambda: decode_attention(q, k, v, lens, tables, args.head_dim ** -0.5, num_splits=splits,
                                                        kv_scales=kv_scales),
                               warmup=50, rep=300, return_mode="median") / 1e3
            print(f"{args.kv_cache_dtype} KV: decode attention batch {args.batch} x context {'varied ' if args.varied else ''}{args.context}, "
                  f"block_size {block_size}, splits {splits or 'auto'}: {seconds * 1e6:.1f} us, "
                  f"{kv_bytes / seconds / 1e12:.2f} TB/s = {kv_bytes / seconds / bandwidth:.3f} of the copy "
                  f"bandwidth ({bandwidth / 1e12:.2f} TB/s)")


def sweep(args):
    """Per batch size, every (splits, BLOCK_N, num_warps, num_stages) on varied context lengths,
    longest first; prints the engine's choice and the five fastest."""
    bandwidth = measure_bandwidth("cuda")
    block_size, max_len = args.block_sizes[0], 2 * args.context
    for batch in args.sweep:
        blocks_per_seq = -(-max_len // block_size)
        k = torch.randn((batch * blocks_per_seq, block_size, args.num_kv_heads, args.head_dim), device="cuda",
                        dtype=torch.bfloat16)
        v = torch.randn_like(k)
        tables = torch.randperm(k.size(0), device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
        g = torch.Generator(device="cuda").manual_seed(batch)
        lens = torch.randint(100, max_len, (batch,), dtype=torch.int32, device="cuda", generator=g)
        lens = lens.sort(descending=True).values
        q = torch.randn(batch, args.num_heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
        kv_scales, per_vector = None, args.head_dim * 2
        if args.kv_cache_dtype == "fp8":
            (k, v, kv_scales), per_vector = to_fp8(k, v), args.head_dim + 4
        kv_bytes = 2 * int(lens.sum()) * args.num_kv_heads * per_vector
        results = []
        configs = [(None, DECODE_BLOCK_N, None, 2), *itertools.product([1, 2, 4, 8], [64, 128], [2, 4, 8], [2, 3, 4])]
        for splits, block_n, warps, stages in configs:
            try:
                seconds = do_bench(lambda: decode_attention(q, k, v, lens, tables, args.head_dim ** -0.5, splits,
                                                            kv_scales=kv_scales, block_n=block_n, num_warps=warps,
                                                            num_stages=stages),
                                   warmup=20, rep=100, return_mode="median") / 1e3
            except Exception as e:  # e.g. out of shared memory
                print(f"batch {batch} splits {splits} BLOCK_N {block_n} warps {warps} stages {stages}: {type(e).__name__}")
                continue
            results.append((seconds, splits, block_n, warps, stages))
        best = sorted(results, key=lambda r: r[0])[:5]
        for name, (seconds, splits, block_n, warps, stages) in [("engine", results[0]), *(("best", r) for r in best)]:
            print(f"{args.kv_cache_dtype} KV batch {batch} {name}: splits {splits or 'auto'} BLOCK_N {block_n} warps {warps} stages {stages}: "
                  f"{seconds * 1e6:.1f} us, {kv_bytes / seconds / bandwidth:.3f} of the copy bandwidth", flush=True)


def verify(args):
    """--q-len: the decode kernel (q_len tokens x query heads per KV head in a program) against the
    prefill kernel's q tiles, with the norm, rotation and K/V store each path needs, and the
    largest difference of their outputs."""
    b, ql, h, kv, d, bs = args.batch, args.q_len, args.num_heads, args.num_kv_heads, args.head_dim, args.block_sizes[0]
    blocks_per_seq = -(-args.context // bs)
    k_cache = torch.randn(b * blocks_per_seq, bs, kv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(k_cache.size(0), device="cuda", dtype=torch.int32).view(b, blocks_per_seq)
    lens = torch.full((b,), args.context, dtype=torch.int32, device="cuda")
    positions = (args.context - ql + torch.arange(ql, device="cuda")).repeat(b)
    slots = (tables.long().gather(1, positions.view(b, ql) // bs) * bs + positions.view(b, ql) % bs).view(-1)
    cu_seqlens_q = torch.arange(0, b * ql + 1, ql, dtype=torch.int32, device="cuda")
    cos_sin = torch.randn(args.context, d, device="cuda")
    q_weight, k_weight = torch.rand(d, device="cuda") + 0.5, torch.rand(d, device="cuda") + 0.5
    q0 = torch.randn(b * ql, h, d, device="cuda", dtype=torch.bfloat16)
    k0, v = (torch.randn(b * ql, kv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cache, scale = (v, k_cache, v_cache, None, None, slots), d ** -0.5

    def prefill_path(q, k):
        rope_store_kv(positions, k, cos_sin, k_weight, 1e-6, cache)
        return prefill_attention(q, k_cache, v_cache, cu_seqlens_q, lens, tables, ql, scale,
                                 new_q=(cos_sin, q_weight, 1e-6))

    def decode_path(q, k, splits):  # norms and rotates q, k in place
        qk_norm_rope(positions, q, k, cos_sin, q_weight, k_weight, 1e-6, kv_cache=cache)
        return decode_attention(q, k_cache, v_cache, lens, tables, scale, num_splits=splits, q_len=ql)

    ref = prefill_path(q0.clone(), k0.clone()).float()
    shape = f"{b} x {ql} tokens, context {args.context}, {h} heads / {kv} KV heads"
    print(f"verify attention {shape}: prefill kernel {do_bench_cudagraph(lambda: prefill_path(q0, k0)) * 1e3:.1f} us")
    auto = decode_num_splits(b, kv, h // kv, torch.device("cuda"))
    for splits in sorted({1, 4, 8, 16, 32, 64, auto}):
        err = (decode_path(q0.clone(), k0.clone(), splits).float() - ref).abs().max().item()
        q, k = q0.clone(), k0.clone()
        us = do_bench_cudagraph(lambda: decode_path(q, k, splits)) * 1e3
        print(f"verify attention {shape}: decode kernel, {splits} splits{' (the rule)' if splits == auto else ''}: "
              f"{us:.1f} us (largest difference from the prefill kernel's {err:.4f})")


if __name__ == "__main__":
    main()
