"""What LoRA adds to a decode step of Qwen3-0.6B at M rows, us per layer: the layer's four products
chained as the model chains them (linear.norm_linear for qkv_proj and gate_up_proj), 28 layers
with their own weights and slot tables in one CUDA graph, through LoRALinearMethod: the base alone,
then with the deltas of rank-R adapters (all M rows spread over N adapters: at one row inside the
base product's launch, kernels/gemv.py's GemvLoRA; at more shrink then expand), on all four kinds
of layers and on qkv_proj alone (an adapter of q and v). Every variant is first checked against
the torch path on the first layer's output (bf16: the two round differently).

    python benchmarks/lora_kernels.py [--m 1 8 16 32 64 256] [--adapters 1 8] [--rank 16]
"""
import argparse

import numpy as np
import torch
from graph_timer import graph_us

from nanovllm.distributed.state import TensorParallel
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, norm_linear
from nanovllm.layers.linear_method import UnquantizedLinearMethod
from nanovllm.layers.lora import LoRAContext, LoRALinearMethod, add_lora_weights, lora_mapping, tile_slots

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 1024, 16, 8, 128, 3072, 28
KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def build(max_loras: int, rank: int, context: LoRAContext):
    tp, method = TensorParallel(), LoRALinearMethod(UnquantizedLinearMethod(), context)
    kind_index = {kind: i for i, kind in enumerate(KINDS)}
    layers = []
    for _ in range(LAYERS):
        mods = (QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, tp, quant_method=method),
                RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, tp, slot=0, quant_method=method),
                MergedColumnParallelLinear(HIDDEN, [INTER, INTER], tp, quant_method=method),
                RowParallelLinear(INTER, HIDDEN, tp, slot=1, gated=True, quant_method=method))
        for mod, kind in zip(mods, KINDS):
            mod.weight.data.normal_(0, 0.02)
            mod.cuda().bfloat16()
            add_lora_weights(mod, kind, max_loras, rank, torch.bfloat16)
            mod.lora_index = len(layers) * len(KINDS) + kind_index[kind]
            mod.lora_a.normal_(0, HIDDEN ** -0.5)
            mod.lora_b.normal_(0, 0.01)
        layers.append(mods)
    return layers, RMSNorm(HIDDEN).cuda().bfloat16()


def forward(layers, norm, x, context):
    context.one_row_s.zero_()  # as the engine does before each one-row step
    res = None
    for qkv_proj, o_proj, gate_up_proj, down_proj in layers:
        qkv, res = norm_linear(x, res, norm, qkv_proj)
        gate_up, res = norm_linear(o_proj(qkv[:, :HEADS * HEAD_DIM].contiguous()), res, norm, gate_up_proj)
        x = down_proj(gate_up)
    return x


def time_graph(fn, reps=30) -> float:
    """us per layer of a CUDA graph of fn() (all layers), replayed."""
    return graph_us(fn, reps) / LAYERS


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 8, 16, 32, 64, 256])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args()
    max_loras = max(args.adapters)
    context = LoRAContext(max_loras, use_triton=True)
    context.all_kinds = frozenset(KINDS)
    context.init_one_row(LAYERS * len(KINDS), args.rank, torch.device("cuda"))
    layers, norm = build(max_loras, args.rank, context)
    print(f"Qwen3-0.6B's four products per layer, {LAYERS} layers in a CUDA graph, rank {args.rank}; us per layer")
    for m in args.m:
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        context.clear()
        base = time_graph(lambda: forward(layers, norm, x, context))
        row = [f"M={m:4d} base {base:6.2f}"]
        for n in args.adapters:
            slots = np.arange(m) % n
            index, num_tiles, groups = lora_mapping(slots, 16, tile_slots(m, max_loras))
            for kinds in (frozenset(KINDS), frozenset({"qkv_proj"})):
                context.set_step(torch.from_numpy(index).cuda(), num_tiles, 16, groups, kinds)
                out = forward(layers[:1], norm, x, context)  # the kernels, then the torch path
                context.use_triton = False
                torch.testing.assert_close(out, forward(layers[:1], norm, x, context), rtol=2e-2, atol=2e-2)
                context.use_triton = True
                us = time_graph(lambda: forward(layers, norm, x, context))
                row.append(f"{n} adapters {'all' if len(kinds) == 4 else 'qkv'} +{us - base:5.2f}")
        print(" | ".join(row))


if __name__ == "__main__":
    main()
