"""Prefill attention alone on Qwen3-0.6B's heads: a step of --num-seqs prompts of --length tokens
(no cached prefix), causal FLOPs (4 * heads * head_dim * sum L^2 / 2) over kernel time, for a few
tile configurations. --decodes D: a mixed step, D decoding sequences (one new token each, contexts
uniform in [length, 2 * length]) first, at the engine's tiling, as decode programs inside the
kernel (the engine from DECODE_PROGRAMS_FROM of them) and as q tiles like the prompts. --fp8: a
float8 cache, read by the kernel (converted tile by tile) or dequantized into a bf16 staging area
first (the engine's way where the blocks fit), at the engine's tiling."""
import argparse

import torch
from triton.testing import do_bench

from nanovllm.kernels.prefill_attention import dequantize_blocks, prefill_attention
from nanovllm.kernels.fp8 import quantize_fp8


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-seqs", type=int, default=16)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--decodes", type=int, default=0)
    p.add_argument("--fp8", action="store_true")
    args = p.parse_args()
    heads, kv_heads, head_dim = 16, 8, 128
    n, L, bs, d = args.num_seqs, args.length, args.block_size, args.decodes
    contexts = torch.randint(L, 2 * L + 1, (d,)).tolist() + [L] * n
    num_blocks = [-(-c // bs) for c in contexts]
    k_cache = torch.randn(sum(num_blocks), bs, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(sum(num_blocks), dtype=torch.int32).split(num_blocks)  # each sequence's blocks, scattered
    tables = torch.zeros(len(contexts), max(num_blocks), dtype=torch.int32)
    for row, blocks in zip(tables, perm):
        row[:len(blocks)] = blocks
    new_tokens = torch.tensor([1] * d + [L] * n)
    cu = torch.zeros(len(contexts) + 1, dtype=torch.int32)
    cu[1:] = new_tokens.cumsum(0)
    q = torch.randn(d + n * L, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    tables, cu, lens = tables.cuda(), cu.cuda(), torch.tensor(contexts, dtype=torch.int32, device="cuda")
    flops = 4 * heads * head_dim * n * L * L / 2
    run = lambda **kw: prefill_attention(q, k_cache, v_cache, cu, lens, tables, L, head_dim ** -0.5, **kw)
    if args.fp8:
        (k8, k_scales), (v8, v_scales) = (quantize_fp8(x.view(-1, kv_heads, head_dim), torch.float8_e4m3fn)
                                          for x in (k_cache, v_cache))
        k8, v8, scales = k8.view(k_cache.shape), v8.view(k_cache.shape), (k_scales.view(k_cache.shape[:3]),
                                                                         v_scales.view(k_cache.shape[:3]))
        blocks = torch.arange(k_cache.size(0), dtype=torch.int32, device="cuda")  # every block, in place
        staging = torch.empty((2, *k_cache.shape), dtype=torch.bfloat16, device="cuda")
        staged = lambda: dequantize_blocks(k8, v8, scales, blocks, staging)
        fp8_run = lambda **kw: prefill_attention(q, k8, v8, cu, lens, tables, L, head_dim ** -0.5, kv_scales=scales,
                                                 **kw)
        for how, fn in (("bf16 cache", run), ("float8, converted in the kernel", fp8_run),
                        ("float8, dequantized into staging", lambda: staged()),
                        ("float8, staged + kernel", lambda: fp8_run(tile_kv=staged()))):
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
            print(f"prefill {n} x {L}, {how}: {ms * 1e3:.1f} us")
        return
    if d:
        decode_bytes = sum(contexts[:d]) * kv_heads * head_dim * 2 * k_cache.element_size()
        for num_decodes, how in ((d, "decode programs"), (0, "q tiles")):
            ms = do_bench(lambda: run(num_decodes=num_decodes), warmup=25, rep=100, return_mode="median")
            print(f"{d} decoding sequences ({decode_bytes / 1e6:.0f} MB of K/V) as {how} + prefill {n} x {L}: "
                  f"{ms * 1e3:.0f} us")
        return
    for bm, bn, warps, stages in [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 2), (64, 128, 8, 2),
                                  (64, 32, 4, 4), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3), (128, 128, 8, 2)]:
        try:
            ms = do_bench(lambda: run(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages),
                          warmup=25, rep=100, return_mode="median")
            print(f"prefill {n} x {L}: BLOCK_M {bm} BLOCK_N {bn} warps {warps} stages {stages}: "
                  f"{ms * 1e3:.0f} us, {flops / ms / 1e9:.0f} TFLOP/s")
        except Exception as e:  # a configuration that does not fit in shared memory
            print(f"BLOCK_M {bm} BLOCK_N {bn} warps {warps} stages {stages}: {type(e).__name__}")


if __name__ == "__main__":
    main()
