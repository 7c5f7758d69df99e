"""Prefill attention alone on Qwen3-0.6B's heads: a step of --num-seqs prompts of --length tokens
(no cached prefix), causal FLOPs (4 * heads * head_dim * sum L^2 / 2) over kernel time, for a few
tile configurations."""
import argparse

import torch
from triton.testing import do_bench

from nanovllm.layers.attention.triton_backend import prefill_attention


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-seqs", type=int, default=16)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=256)
    args = p.parse_args()
    heads, kv_heads, head_dim = 16, 8, 128
    n, L, bs = args.num_seqs, args.length, args.block_size
    blocks = n * -(-L // bs)
    k_cache = torch.empty(blocks, bs, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(n, -1)
    positions = torch.arange(L, device="cuda")
    slots = (tables.long()[:, positions // bs] * bs + positions % bs).flatten()
    for cache in (k_cache, v_cache):
        cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(n * L, kv_heads, head_dim, device="cuda",
                                                                 dtype=torch.bfloat16)
    q = torch.randn(n * L, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, n * L + 1, L, device="cuda", dtype=torch.int32)
    lens = torch.full((n,), L, device="cuda", dtype=torch.int32)
    flops = 4 * heads * head_dim * n * L * L / 2
    for bm, bn, warps, stages in [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 2), (64, 128, 8, 2),
                                  (64, 32, 4, 4), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3), (128, 128, 8, 2)]:
        try:
            ms = do_bench(lambda: prefill_attention(q, k_cache, v_cache, cu, lens, tables, L, head_dim ** -0.5,
                                                    block_m=bm, block_n=bn, num_warps=warps, num_stages=stages),
                          warmup=25, rep=100, return_mode="median")
            print(f"prefill {n} x {L}: BLOCK_M {bm} BLOCK_N {bn} warps {warps} stages {stages}: "
                  f"{ms * 1e3:.0f} us, {flops / ms / 1e9:.0f} TFLOP/s")
        except Exception as e:  # a configuration that does not fit in shared memory
            print(f"BLOCK_M {bm} BLOCK_N {bn} warps {warps} stages {stages}: {type(e).__name__}")


if __name__ == "__main__":
    main()
