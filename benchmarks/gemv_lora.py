"""What an adapter adds to each one-row product of Qwen3-0.6B when it rides in the product's own
launch (kernels/gemv.py's GemvLoRA): us per product, 28 launches of one shape with their own
weights, rank-16 slot tables and buffers of s, in a CUDA graph (the buffers zeroed in it, as the
engine zeroes them before a one-row step), without and with the adapter.

    python benchmarks/gemv_lora.py [--copies 8]
"""
import argparse

import torch
from graph_timer import graph_us

from nanovllm.kernels.gemv import GemvLoRA, gemv, norm_gemv

SHAPES = (("qkv_proj", 4096, 1024, (0, 2048, 3072, 4096), True), ("o_proj", 1024, 2048, (0, 1024), False),
          ("gate_up_proj", 6144, 1024, (0, 3072, 6144), True), ("down_proj", 1024, 3072, (0, 1024), False))
LAYERS, RANK, SLOTS = 28, 16, 8


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--copies", type=int, default=8, help="copies of s (a power of two)")
    args = p.parse_args()
    torch.manual_seed(0)
    tiles = torch.tensor([[0, 0, 1]] + [[-1, 0, 0]] * 3, dtype=torch.int32, device="cuda")
    print(f"one-row products, {LAYERS} launches in a CUDA graph, rank {RANK}, {args.copies} copies; us per product")
    for name, n, k, bounds, norm in SHAPES:
        sr = (len(bounds) - 1) * RANK
        layers = [((torch.randn(n, k, device="cuda") * 0.02).bfloat16(),
                   (torch.randn(SLOTS, sr, k, device="cuda") * 0.03).bfloat16(),
                   (torch.randn(SLOTS, n, RANK, device="cuda") * 0.1).bfloat16()) for _ in range(LAYERS)]
        x, res = torch.randn(2, 1, 2 * k if name == "down_proj" else k, device="cuda").bfloat16()
        norm_weight = torch.ones(k, device="cuda").bfloat16()
        words = torch.zeros(LAYERS, args.copies, 64, dtype=torch.int32, device="cuda")

        def run(lora: bool):
            words.zero_()
            for i, (w, a, b) in enumerate(layers):
                adapter = GemvLoRA(a, b, tiles, bounds, words[i]) if lora else None
                if norm:
                    norm_gemv(x, res[:, :k], norm_weight, 1e-6, w, lora=adapter)
                else:
                    gemv(x, w, gated=name == "down_proj", lora=adapter)
        base, lora = (graph_us(lambda: run(flag), reps=50) / LAYERS for flag in (False, True))
        print(f"{name:13s} base {base:6.2f} | with the adapter {lora:6.2f} (+{lora - base:.2f})")


if __name__ == "__main__":
    main()
