"""The fused-MoE layer alone from its router's logits (kernels/fused_moe.fused_moe: the top-k
routing included) at Qwen3-30B-A3B's shapes, 128 experts of 2048 -> 768 -> 2048, 8 per token,
renormalised, random normal logits (uniform routing), bf16 (--fp8: float8 experts). For each
token count: microseconds per layer, the bytes it must move (the distinct experts its tokens
touch, x in and the output out; not the kernels' intermediates) and its FLOPs, the layer's
roofline (bytes at the measured bandwidth or FLOPs at the measured bf16 matmul rate, whichever is
longer) and the fraction of it reached; for the default config, the other path, the sweep's
tilings (--sweep) and a per-expert loop of torch matmuls (moe_method.torch_experts, eager, the
routing given: it reads the routing on the host). Each config is first checked against a float32
product. Where the default is the sorted path, its layout (moe_align_block_size: counted where it
fits, and sorted) and its top-k sum (moe_sum, and torch.sum) are timed alone too.

Timings: a CUDA graph of --layers layers with their own weights (4 x 1.2 GB: weights from HBM,
not L2), us per layer; the torch loop eagerly over the same layers. The best config per size is
printed last, as MoEConfig arguments for default_config.

    PYTHONPATH=. python benchmarks/moe.py [--tokens 1 8 64 256 4096] [--tp 2] [--fp8] [--sweep]
"""
import argparse

import torch

from bench import measure_bandwidth, measure_matmul_flops
from nanovllm.kernels.fp8 import quantize_fp8
from nanovllm.kernels.fused_moe import MoEConfig, default_config, fused_moe, moe_sum
from nanovllm.kernels.moe_routing import max_counted_pairs, moe_align_block_size, moe_topk
from nanovllm.layers.moe_method import torch_experts

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
PAIR_SWEEP = [MoEConfig(pairs=True, pair_n=n, pair_k=k, pair_warps=w, down_n=dn, down_k=dk, pair_stages=st)
              for n, k, w, dn, dk, st in [(8, 512, 4, 8, 128, 1), (8, 512, 8, 8, 128, 3), (4, None, 4, 8, 128, 3),
                                          (16, 256, 4, 8, 128, 3), (16, 256, 4, 4, 256, 3), (16, 256, 4, 4, 256, 1),
                                          (32, 256, 4, 4, 256, 3), (8, 512, 4, 4, 256, 3), (16, 256, 4, 8, 256, 3),
                                          (16, 256, 4, 16, 128, 3), (16, 256, 4, 2, 512, 3), (16, 512, 4, 4, 256, 3),
                                          (8, 1024, 4, 4, 256, 3), (16, 256, 4, 4, 1024, 1), (16, 256, 4, 2, 1024, 1),
                                          (16, 256, 4, 8, 256, 1), (32, 512, 4, 8, 256, 3)]]
SORTED_SWEEP = [MoEConfig(block_m=m, block_n=n, block_k=k, group_m=g, num_warps=w, num_stages=s)
                for m, n, k, g, w, s in [
                    (16, 32, 128, 1, 4, 3), (16, 64, 128, 1, 4, 3), (16, 64, 256, 1, 4, 2), (16, 128, 128, 1, 4, 3),
                    (32, 64, 128, 4, 4, 3), (32, 128, 64, 8, 4, 4), (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 3),
                    (64, 128, 64, 8, 4, 4), (64, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3), (64, 256, 64, 8, 8, 2)]]


def layer_weights(layers, inter, fp8, g):
    """[(w13, w2, w13_scale, w2_scale)] per layer, N(0, 0.02) as bench.py's dummy weights."""
    out = []
    for _ in range(layers):
        w13 = torch.empty(EXPERTS, 2 * inter, HIDDEN, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
        w2 = torch.empty(EXPERTS, HIDDEN, inter, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
        if fp8:
            (w13, s13), (w2, s2) = quantize_fp8(w13), quantize_fp8(w2)
            out.append((w13, w2, s13, s2))
        else:
            out.append((w13, w2, None, None))
    return out


def time_layers(fn, layers, graph=True, reps=20):
    """us per layer of fn(layer index) over `layers` layers: replays of a CUDA graph of all of them,
    or (graph=False) eager calls."""
    def all_layers():
        for i in range(layers):
            fn(i)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        all_layers()  # compiles, warms the allocator
    torch.cuda.current_stream().wait_stream(stream)
    run = all_layers
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            all_layers()
        run = g.replay
    for _ in range(3):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / layers


def describe(config):
    if config.pairs:
        return (f"pairs n{config.pair_n} k{config.pair_k} w{config.pair_warps} down n{config.down_n} "
                f"k{config.down_k} s{config.pair_stages}")
    return (f"sorted m{config.block_m} n{config.block_n} k{config.block_k} g{config.group_m} "
            f"w{config.num_warps} s{config.num_stages}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 4096])
    p.add_argument("--tp", type=int, default=1, help="one rank's share of each expert (intermediate 768 / tp)")
    p.add_argument("--fp8", action="store_true", help="float8 expert weights, a scale per output row")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sweep", action="store_true", help="also time the tilings of PAIR_SWEEP and SORTED_SWEEP")
    args = p.parse_args()
    g = torch.Generator("cuda").manual_seed(0)
    inter = INTER // args.tp
    bandwidth, flops = measure_bandwidth("cuda"), measure_matmul_flops("cuda")
    weights = layer_weights(args.layers, inter, args.fp8, g)
    weight_bytes = 1 if args.fp8 else 2
    expert_bytes = 3 * HIDDEN * inter * weight_bytes + (4 * (2 * inter + HIDDEN) if args.fp8 else 0)
    print(f"{torch.cuda.get_device_name()}: {bandwidth / 1e12:.2f} TB/s, {flops / 1e12:.0f} TFLOP/s bf16; "
          f"{EXPERTS} experts {HIDDEN} -> {inter} -> {HIDDEN}, top {TOP_K}, {'fp8' if args.fp8 else 'bf16'} weights")
    print(f"{'tokens':>6} {'config':<34} {'us/layer':>9} {'touched':>7} {'MB':>8} {'GFLOP':>7} {'roof us':>8} "
          f"{'fraction':>8}")
    best = {}
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
        logits = torch.randn(tokens, EXPERTS, device="cuda", dtype=torch.bfloat16, generator=g)
        topk_weights, topk_ids = moe_topk(logits, TOP_K, True)
        touched = topk_ids.unique().numel()
        nbytes = touched * expert_bytes + 2 * tokens * HIDDEN * 2
        flop = 2 * tokens * TOP_K * 3 * HIDDEN * inter
        roof = max(nbytes / bandwidth, flop / flops) * 1e6
        w13, w2, s13, s2 = weights[0]
        exact = torch_experts(x.float(), w13.float(), w2.float(), topk_weights, topk_ids, s13, s2)
        default = default_config(tokens, TOP_K, EXPERTS)
        other = MoEConfig(pairs=not default.pairs) if tokens <= 256 else None
        configs = [default] + ([other] if other else [])
        if args.sweep:
            configs += [c for c in (PAIR_SWEEP if tokens <= 64 else []) + SORTED_SWEEP if c not in configs]
        if not default.pairs:
            for counted in (True, False) if tokens * TOP_K <= max_counted_pairs(EXPERTS) else (False,):
                us = time_layers(lambda i: moe_align_block_size(topk_ids, EXPERTS, default.block_m, counted=counted),
                                 args.layers)
                print(f"{tokens:>6} {'layout, ' + ('counted' if counted else 'sorted'):<34} {us:9.1f}")
            # the top-k sum over 48 outputs (more than L2 holds), by moe_sum and by torch.sum
            ys = [torch.randn(tokens * TOP_K, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
                  for _ in range(48)]
            summed = torch.empty(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
            for name, fn in [("moe_sum", lambda i: moe_sum(ys[i], summed)),
                             ("torch.sum", lambda i: torch.sum(ys[i].view(tokens, TOP_K, HIDDEN), 1, out=summed))]:
                print(f"{tokens:>6} {'top-k sum, ' + name:<34} {time_layers(fn, len(ys)):9.1f}")
            del ys
        out = torch.empty_like(x)
        rows = []
        for config in configs:
            try:  # a tiling may not fit this GPU's shared memory
                got = fused_moe(x, logits, w13, w2, TOP_K, True, s13, s2, config=config)
            except Exception as e:  # Triton's OutOfResources and compile errors
                print(f"{tokens:>6} {describe(config):<34} FAILED: {type(e).__name__}: {str(e)[:80]}")
                continue
            err = ((got.float() - exact).abs().max() / exact.abs().max()).item()
            if not err < 2**-6:  # bf16 rounding of h, of each expert's output and of the sum
                print(f"{tokens:>6} {describe(config):<34} WRONG: max error {err:.3g} of the largest output")
                continue
            us = time_layers(lambda i, c=config: fused_moe(x, logits, *weights[i][:2], TOP_K, True, *weights[i][2:],
                                                            out=out, config=c), args.layers)
            rows.append((us, config))
            tag = " (default)" if config is default else ""
            print(f"{tokens:>6} {describe(config) + tag:<34} {us:9.1f} {touched:7d} {nbytes / 1e6:8.1f} "
                  f"{flop / 1e9:7.2f} {roof:8.1f} {roof / us:8.3f}")
        us = time_layers(lambda i: torch_experts(x, *weights[i][:2], topk_weights, topk_ids, *weights[i][2:], out=out),
                         args.layers, graph=False, reps=5)
        print(f"{tokens:>6} {'torch loop over experts (eager)':<34} {us:9.1f} {touched:7d} {nbytes / 1e6:8.1f} "
              f"{flop / 1e9:7.2f} {roof:8.1f} {roof / us:8.3f}")
        if rows:
            best[tokens] = min(rows, key=lambda r: r[0])
    print("fastest per size:")
    for tokens, (us, config) in best.items():
        fields = {k: v for k, v in vars(config).items() if v != getattr(MoEConfig(), k)}
        print(f"  {tokens:>5} tokens: {us:8.1f} us  MoEConfig({', '.join(f'{k}={v}' for k, v in fields.items())})")


if __name__ == "__main__":
    main()
