"""FP8-weight GEMMs of Qwen3-8B (or --model qwen3-0.6b, qwen3-30b-a3b's attention) at decode batch sizes: bf16
cuBLAS (F.linear), the W8A8 path (fp8_kernel.quantize_rows + torch._scaled_mm, row-wise scales)
and the W8A16 Triton kernel (fp8_kernel.fp8_weight_gemm, tensor cores) in several tilings; one row
is benchmarks/gemv.py's. Each timing is a CUDA
graph of 28 products with 28 different weights (decode_gemm.time_graph: weights from HBM, not
L2), us per product; every path is first checked against a float32 product of the same float8
weights. Prints TB/s of the float8 weight bytes for the best Triton tiling.

    python benchmarks/fp8_gemm.py [--model qwen3-8b] [--m 16 64 128 256]
"""
import argparse

import torch
import torch.nn.functional as F
import triton
from decode_gemm import LAYERS, time_graph

from nanovllm.kernels.fp8 import quantize_fp8
from nanovllm.kernels.fp8_gemm import fp8_weight_gemm, quantize_rows

SHAPES = {"qwen3-8b": {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096),
                       "down_proj": (4096, 12288)},
          "qwen3-0.6b": {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024),
                         "down_proj": (1024, 3072)},
          "qwen3-30b-a3b": {"qkv_proj": (5120, 2048), "o_proj": (2048, 4096)}}  # attention's; experts: moe.py
CONFIGS = [(16, 256, 4, 4), (16, 512, 4, 3), (16, 512, 8, 4), (32, 256, 4, 4), (32, 512, 4, 3), (32, 128, 4, 4),
           (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (128, 256, 8, 3)]


def scaled_mm(x, w, s):
    qx, sx = quantize_rows(x)
    return torch._scaled_mm(qx, w.t(), scale_a=sx.unsqueeze(1), scale_b=s.unsqueeze(0), out_dtype=torch.bfloat16)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b", choices=list(SHAPES))
    p.add_argument("--m", type=int, nargs="+", default=[16, 64, 128, 256])
    args = p.parse_args()
    torch.manual_seed(0)
    totals = {}
    for name, (N, K) in SHAPES[args.model].items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(LAYERS)]
        qs = [quantize_fp8(w) for w in ws]
        for M in args.m:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = (qs[0][0].float() * qs[0][1][:, None]).t()
            ref, qx = x.float() @ w, quantize_fp8(x)
            tol = 2**-7 * ref.abs().max().item()  # the bf16 output's rounding, with margin
            timings = {"bf16 cuBLAS": time_graph(lambda i: F.linear(x, ws[i]))}
            assert ((scaled_mm(x, *qs[0]).float() - (qx[0].float() * qx[1][:, None]) @ w).abs().max() < tol)
            timings["W8A8 _scaled_mm"] = time_graph(lambda i: scaled_mm(x, *qs[i]))
            for cfg in CONFIGS:
                try:
                    err = (fp8_weight_gemm(x, *qs[0], cfg).float() - ref).abs().max().item()
                except triton.runtime.errors.OutOfResources:
                    continue
                if not err < tol:
                    print(f"  {name} M={M} {cfg}: WRONG (max err {err:.3g})")
                    continue
                timings[f"W8A16 {cfg}"] = time_graph(lambda i: fp8_weight_gemm(x, *qs[i], cfg))
            best = min((k for k in timings if k.startswith("W8A16")), key=timings.get)
            print(f"{name:>12} N={N} K={K} M={M:3d}: " + ", ".join(
                f"{k} {timings[k]:.1f}" for k in ("bf16 cuBLAS", "W8A8 _scaled_mm")) +
                f" us; best {best} {timings[best]:.1f} us = {N * K / timings[best] / 1e6:.2f} TB/s", flush=True)
            for k, us in timings.items():
                totals[(M, k)] = totals.get((M, k), 0.0) + us
    print("one layer's four products, us (the four fastest):")
    for M in args.m:
        row = {k: v for (m, k), v in totals.items() if m == M}
        print(f"M={M}: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(row.items(), key=lambda kv: kv[1])[:4]))


if __name__ == "__main__":
    main()
