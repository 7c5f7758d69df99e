"""Decode-step products of Qwen3-0.6B (or --model qwen3-8b) at M rows (a decode step of M
sequences, or a verify step's 1 + k rows of one), us per layer.

Default: a layer's four products chained as the model chains them (linear.norm_linear for qkv_proj
and gate_up_proj, linear.linear for o_proj and down_proj), 28 layers with their own weights in
one CUDA graph (weights from HBM, not L2): the engine's path (the GEMV at one row, skinny_gemm at
2 to SKINNY_MAX_ROWS) against cuBLAS (RMSNorm, F.linear, silu_and_mul as their own kernels).
--sweep: each product alone, 28 in a graph, skinny_gemm's tilings against cuBLAS, every tiling
first checked against a float32 product. Findings: docs/perf-log.md.

    python benchmarks/decode_gemm.py [--model qwen3-0.6b|qwen3-8b] [--m 1 2 4 8 16 32 64] [--sweep]
"""
import argparse
import itertools

import torch
import torch.nn.functional as F
from graph_timer import graph_us

from nanovllm.layers import linear_method as linear_mod
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import ColumnParallelLinear, RowParallelLinear, norm_linear
from nanovllm.kernels.skinny_gemm import silu_and_mul_rows, skinny_config, skinny_linear
from nanovllm.distributed.state import TensorParallel

MODELS = {"qwen3-0.6b": (1024, 2048, 1024, 3072, 28), "qwen3-8b": (4096, 4096, 1024, 12288, 36)}  # from their configs
HIDDEN, Q, KV, INTER, LAYERS = MODELS["qwen3-0.6b"]  # hidden, q and kv widths, intermediate, layers (main sets them)
ONE_ROW = linear_mod.one_row


def time_graph(fn, reps=30):
    """us per call of a CUDA graph of LAYERS calls fn(layer), replayed."""
    return graph_us(lambda: [fn(i) for i in range(LAYERS)], reps) / LAYERS


def chain(ms):
    tp = TensorParallel()
    layers = []
    for _ in range(LAYERS):
        mods = (ColumnParallelLinear(HIDDEN, Q + 2 * KV, tp), RowParallelLinear(Q, HIDDEN, tp, slot=0),
                ColumnParallelLinear(HIDDEN, 2 * INTER, tp), RowParallelLinear(INTER, HIDDEN, tp, slot=1, gated=True))
        for mod in mods:
            mod.weight.data.normal_(0, 0.02)
        layers.append([mod.cuda().bfloat16() for mod in mods])
    norm = RMSNorm(HIDDEN).cuda().bfloat16()

    def layer(state, i):
        qkv_proj, o_proj, gate_up_proj, down_proj = layers[i]
        x, res = state
        qkv, res = norm_linear(x, None if i == 0 else res, norm, qkv_proj)
        gate_up, res = norm_linear(o_proj(qkv[:, :Q]), res, norm, gate_up_proj)
        state[:] = down_proj(gate_up), res

    for m in ms:
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        us = {}
        for path, max_rows in (("cuBLAS", 0), ("engine", linear_mod.SKINNY_MAX_ROWS)):
            saved, linear_mod.SKINNY_MAX_ROWS = linear_mod.SKINNY_MAX_ROWS, max_rows
            if m == 1 and path == "cuBLAS":  # the GEMV is the engine's one-row path; cuBLAS via two rows' first
                linear_mod.one_row = lambda x: False
            out = [x, None]
            for i in range(2):
                layer(out, i)
            state = [x, None]
            us[path] = (time_graph(lambda i: layer(state, i)), out[0].float())
            linear_mod.SKINNY_MAX_ROWS = saved
            linear_mod.one_row = ONE_ROW
        err = ((us["engine"][1] - us["cuBLAS"][1]).abs().max() / us["cuBLAS"][1].abs().max()).item()
        print(f"M={m:3d}: cuBLAS chain {us['cuBLAS'][0]:6.2f} us per layer, engine {us['engine'][0]:6.2f} "
              f"(two layers' outputs apart by {err:.2g} of the largest)", flush=True)


def sweep(ms):
    shapes = {"qkv_proj": (Q + 2 * KV, HIDDEN), "o_proj": (HIDDEN, Q), "gate_up_proj": (2 * INTER, HIDDEN),
              "down_proj": (HIDDEN, INTER)}
    for name, (n, k) in shapes.items():
        gated = name == "down_proj"
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(LAYERS)]
        configs = [c for c in itertools.product([16, 32, 64], [128, 256, 512], [2, 4], [3, 4], [1, 2, 4])
                   if k % (c[1] * c[4]) == 0]  # (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K)
        for m in ms:
            x = torch.randn(m, (2 if gated else 1) * k, device="cuda", dtype=torch.bfloat16)
            a = silu_and_mul_rows(x) if gated else x  # the engine's chain: the gate, then the product
            ref = a.float() @ ws[0].float().T
            cublas = time_graph(lambda i: F.linear(a, ws[i]))
            results = []
            for cfg in configs:
                try:
                    y = skinny_linear(a, ws[0], config=cfg)
                except Exception as e:  # a tiling's pipeline stages over shared memory
                    print(f"  {name} M={m} {cfg}: {type(e).__name__}")
                    continue
                if not ((y.float() - ref).abs().max() / ref.abs().max()).item() < 2**-6:
                    print(f"  {name} M={m} {cfg}: WRONG")
                    continue
                results.append((time_graph(lambda i: skinny_linear(a, ws[i], config=cfg)), cfg))
            default = time_graph(lambda i: skinny_linear(a, ws[i]))
            results.sort()
            print(f"{name:>12} M={m:3d}: cuBLAS {cublas:5.2f} us, skinny_config {skinny_config(m, n, k)} {default:5.2f}; "
                  "best (BLOCK_N, BLOCK_K, warps, stages, split) " + "; ".join(f"{c} {t:.2f}" for t, c in results[:3]),
                  flush=True)


@torch.inference_mode()
def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 48, 64])
    p.add_argument("--sweep", action="store_true", help="each product alone over skinny_gemm's tilings")
    p.add_argument("--model", choices=MODELS, default="qwen3-0.6b", help="whose shapes and layer count")
    args = p.parse_args()
    global HIDDEN, Q, KV, INTER, LAYERS
    HIDDEN, Q, KV, INTER, LAYERS = MODELS[args.model]
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    (sweep if args.sweep else chain)(args.m)


if __name__ == "__main__":
    main()
