"""Decode-step GEMMs of Qwen3-0.6B: cuBLAS (F.linear) against Triton tilings, at the batch sizes of
decode steps. Each timing is a CUDA graph of 28 products with 28 different weights (one per layer,
so weights come from HBM, not L2, as in the model), replayed; us per product. Split-K tilings
are timed with their partial sums added by a separate kernel and alone (as if a following kernel,
e.g. the residual RMSNorm, summed them). Every tiling is first checked against a float32 product.
Findings (H200): benchmarks/NOTES.md.

    python benchmarks/decode_gemm.py [--m 16 64 128 256] [--shapes o_proj down_proj]
"""
import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024), "down_proj": (1024, 3072)}
LAYERS = 28


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """y[pid_k] = x[:, k-slice] @ w[:, k-slice].T; adjacent programs share an N tile (the weight tile
    is read from HBM once and from L2 by the other M tiles)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_len = K // SPLIT_K
    rk = pid_k * k_len + tl.arange(0, BLOCK_K)
    x = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w = w_ptr + rn[None, :] * stride_wn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, k_len, BLOCK_K):
        a = tl.load(x, mask=rm[:, None] < M, other=0.0)
        acc = tl.dot(a, tl.load(w), acc)
        x += BLOCK_K
        w += BLOCK_K
    y = y_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=rm[:, None] < M)


def triton_linear(x, w, out, cfg):
    """x [M, K] @ w [N, K].T with cfg = (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split) into out
    [|split|, M, N] (float32 when split > 1); N must divide by BLOCK_N and K by BLOCK_K x |split|.
    Returns the sum over splits (split >= 1) or the partial sums themselves (split < 0)."""
    bm, bn, bk, warps, stages, split = cfg
    M, K = x.shape
    N = w.shape[0]
    grid = (triton.cdiv(M, bm), N // bn, abs(split))
    _gemm_kernel[grid](x, w, out, M, N, K, x.stride(0), w.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                       SPLIT_K=abs(split), num_warps=warps, num_stages=stages)
    return out if split < 0 else out.sum(0) if split > 1 else out[0]


def time_graph(fn, reps=20):
    """us per product of a CUDA graph of LAYERS calls of fn(layer)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(LAYERS):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(LAYERS):
            fn(i)
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / LAYERS


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[16, 64, 128, 256])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--top", type=int, default=4, help="Triton configurations printed per shape and M")
    args = p.parse_args()
    torch.manual_seed(0)
    configs = [(bm, bn, bk, w, 4 if bk == 64 else 3, s)
               for bm, bn, bk, w, s in itertools.product([64, 128], [32, 64, 128], [64, 128], [4, 8], [1, 2, 4, 8])
               if not (w == 8 and bm * bn < 128 * 64)]
    total = {}
    for name in args.shapes:
        N, K = SHAPES[name]
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(LAYERS)]
        for M in args.m:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), ws[0].float())
            cublas = time_graph(lambda i: F.linear(x, ws[i]))
            results = []  # (us with the split-K sum, us of the kernel alone, config)
            for cfg in configs:
                if K % (cfg[2] * cfg[5]):
                    continue
                out = torch.full((cfg[5], M, N), float("nan"), device="cuda",
                                 dtype=torch.float32 if cfg[5] > 1 else torch.bfloat16)
                y = triton_linear(x, ws[0], out, cfg)
                err = (y.float() - ref).abs().max().item()
                if not err < 0.05 * ref.abs().max().item():
                    print(f"  {name} M={M} {cfg}: WRONG (max err {err:.3g})")
                    continue
                us = time_graph(lambda i: triton_linear(x, ws[i], out, cfg))
                alone = time_graph(lambda i: triton_linear(x, ws[i], out, cfg[:5] + (-cfg[5],))) if cfg[5] > 1 else us
                results.append((us, alone, cfg))
            results.sort(key=lambda r: r[1])
            floor_us = N * K * 2 / 3.3e12 * 1e6
            print(f"{name:>12} N={N} K={K} M={M:3d}: cuBLAS {cublas:6.2f} us; weight bytes at 3.3 TB/s {floor_us:.2f} us",
                  flush=True)
            for us, alone, cfg in results[:args.top]:
                print(f"    (BM, BN, BK, warps, stages, split) {cfg}: {alone:6.2f} us alone, {us:6.2f} us with the sum")
            t = total.setdefault(M, [0.0, 0.0, 0.0])
            t[0] += cublas * LAYERS
            t[1] += min(cublas, min(r[0] for r in results)) * LAYERS
            t[2] += min(cublas, results[0][1]) * LAYERS
    for M, (c, b, a) in total.items():
        print(f"M={M}: GEMMs of 28 layers: cuBLAS {c / 1e3:.3f} ms, best {b / 1e3:.3f} ms, "
              f"best with split-K sums left to a consumer {a / 1e3:.3f} ms")


if __name__ == "__main__":
    main()
