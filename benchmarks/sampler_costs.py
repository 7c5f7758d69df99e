"""The Sampler alone on one decode step's logits (bf16, rows x Qwen3's 151,936 vocabulary): time
per call of each sampling path, and of its pieces, with the bytes of one read of the logits for scale."""
import argparse

import torch
from triton.testing import do_bench

from nanovllm.sampling.sampler import Sampler, SamplingTensors, token_logprobs
from nanovllm.kernels.logits_stats import chunked_topk, logsumexp_and_rank


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151936)
    args = p.parse_args()
    n, dev = args.rows, "cuda"
    logits = torch.randn(n, args.vocab, device=dev, dtype=torch.bfloat16) * 3
    temps = torch.full((n,), 0.6, device=dev)
    all_rows = torch.arange(n, device=dev)
    seeded = (torch.arange(0, n, 8, device=dev), torch.arange(0, n, 8, device=dev) * 7919)
    cases = {
        "temperature (Gumbel-max kernel)": SamplingTensors(temps),
        "temperature, logprobs 5": SamplingTensors(temps, num_logprobs=5, logprob_rows=all_rows),
        "top_k 20 top_p 0.95 (top-k path)": SamplingTensors(temps, top_k=torch.full((n,), 20, device=dev), max_top_k=20,
                                                            top_p=torch.full((n,), 0.95, device=dev)),
        "top_k 20, 1 in 8 rows seeded": SamplingTensors(temps, top_k=torch.full((n,), 20, device=dev), max_top_k=20,
                                                        seeds=seeded),
        "top_p 0.95 (nucleus kernel)": SamplingTensors(temps, top_p=torch.full((n,), 0.95, device=dev)),
        "top_p 0.9 min_p 0.05 (nucleus kernel)": SamplingTensors(temps, top_p=torch.full((n,), 0.9, device=dev),
                                                                 min_p=torch.full((n,), 0.05, device=dev)),
    }
    sampler, tokens = Sampler(seed=0), logits.argmax(-1)
    print(f"{n} x {args.vocab} bf16 logits; one read of them: {logits.numel() * 2 / 3e12 * 1e6:.0f} us at 3 TB/s")
    for name, st in cases.items():
        print(f"{name:>36}: {do_bench(lambda: sampler(logits, st)) * 1e3:8.1f} us")
    pieces = {f"{name}({k})": (lambda fn=fn, k=k: fn(logits, k)) for k in (5, 20, 64)
              for name, fn in (("torch.topk", torch.topk), ("chunked_topk", chunked_topk))}
    pieces |= {"logsumexp_and_rank": lambda: logsumexp_and_rank(logits, tokens),
               "token_logprobs(5)": lambda: token_logprobs(logits, tokens, 5)}
    for name, fn in pieces.items():
        print(f"{name:>36}: {do_bench(fn) * 1e3:8.1f} us")


if __name__ == "__main__":
    main()
