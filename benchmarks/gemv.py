"""One-row products (the decode step of one sequence) of Qwen3-0.6B and -8B, and Qwen3-30B-A3B's
attention: cuBLAS (F.linear) and the float8 W8A16 GEMM against kernels/gemv.py's kernel with its
default tiling, in bf16 and float8 weights, down_proj with silu(gate) * up as a kernel of its
own against fused into the GEMV's loads, and qkv/gate_up with the RMSNorm (and residual add)
before them likewise. Each timing is a CUDA graph of 28 products with 28 different weights
(decode_gemm.time_graph: weights from HBM, not L2), us per product; every result is first checked
against a float32 product. --sweep times every tiling of a grid instead and prints the fastest per
model and dtype.

    python benchmarks/gemv.py [--sweep [--model qwen3-30b-a3b ...]]
"""
import argparse
import itertools

import torch
import torch.nn.functional as F
from decode_gemm import LAYERS, time_graph
from fp8_gemm import SHAPES

from nanovllm.kernels.activation import silu_and_mul
from nanovllm.kernels.fp8 import quantize_fp8
from nanovllm.kernels.fp8_gemm import fp8_weight_gemm
from nanovllm.kernels.gemv import gemv, norm_gemv
from nanovllm.layers.layernorm import RMSNorm

SWEEP = list(itertools.product([1, 2, 4, 8], [512, 1024, 2048], [4, 8], [3, 4]))  # (BLOCK_N, BLOCK_K, warps, stages)


def operands(n, k, fp8):
    """LAYERS weights [n, k] (bf16, or float8 with scales) and their first one in float32."""
    ws = [torch.randn(n, k, device="cuda") * 0.05 for _ in range(LAYERS)]
    ws = [quantize_fp8(w) if fp8 else (w.bfloat16(), None) for w in ws]
    w, s = ws[0]
    return ws, w.float() * (1 if s is None else s[:, None])


def check(y, ref):
    err = (y.float() - ref).abs().max().item()
    assert err < 2**-7 * ref.abs().max().item(), f"max error {err:.3g}"


def compare():
    for model, fp8 in itertools.product(SHAPES, (False, True)):
        layer = {}
        for name, (n, k) in SHAPES[model].items():
            ws, w0 = operands(n, k, fp8)
            gated = name == "down_proj"
            x = torch.randn(1, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
            a = silu_and_mul(x) if gated else x
            ref = a.float() @ w0.t()
            base = (lambda i: fp8_weight_gemm(silu_and_mul(x) if gated else x, *ws[i])) if fp8 else \
                (lambda i: F.linear(silu_and_mul(x) if gated else x, ws[i][0]))
            check(base(0), ref)
            check(gemv(x, *ws[0], gated=gated), ref)
            t = {"baseline": time_graph(base), "gemv": time_graph(lambda i: gemv(x, *ws[i], gated=gated))}
            if gated:
                t["gemv, gate unfused"] = time_graph(lambda i: gemv(silu_and_mul(x), *ws[i]))
            if name in ("qkv_proj", "gate_up_proj"):
                norm, res = RMSNorm(k).cuda().bfloat16(), torch.randn_like(x)
                t["RMSNorm + gemv"] = time_graph(lambda i: gemv(norm(x, res)[0], *ws[i]))
                t["norm_gemv"] = time_graph(lambda i: norm_gemv(x, res, norm.weight, norm.eps, *ws[i])[0])
            print(f"{model} {'fp8' if fp8 else 'bf16'} {name} N={n} K={k}: " +
                  ", ".join(f"{key} {us:.2f} us" for key, us in t.items()) +
                  f" ({n * k * ws[0][0].element_size() / t['gemv'] / 1e6:.2f} TB/s)",
                  flush=True)
            for key in ("baseline", "gemv"):
                layer[key] = layer.get(key, 0.0) + t[key]
        print(f"{model} {'fp8 (baseline fp8_weight_gemm)' if fp8 else 'bf16 (baseline cuBLAS)'}: one layer "
              f"{layer['baseline']:.1f} -> {layer['gemv']:.1f} us", flush=True)


def sweep(models):
    for model, fp8 in itertools.product(models, (False, True)):
        per = {}
        for name, (n, k) in SHAPES[model].items():
            ws, w0 = operands(n, k, fp8)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ w0.t()
            for cfg in SWEEP:
                if cfg[1] <= k:
                    check(gemv(x, *ws[0], config=cfg), ref)
                    per.setdefault(cfg, {})[name] = time_graph(lambda i: gemv(x, *ws[i], config=cfg))
        layer = {cfg: sum(t.values()) for cfg, t in per.items() if len(t) == len(SHAPES[model])}
        best = sorted(layer, key=layer.get)[:5]
        print(f"{model} {'fp8' if fp8 else 'bf16'}: fastest tilings, us per layer:",
              [(cfg, round(layer[cfg], 1)) for cfg in best], flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--model", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="the sweep's models")
    args = p.parse_args()
    torch.manual_seed(0)
    sweep(args.model) if args.sweep else compare()
