"""Tensor-parallel smoke run with timings: greedy tokens of a dummy model at TP=1 and TP=2, how
many sequences agree and where the first differ.

python benchmarks/tp_smoke.py [--model qwen3-8b] [--dtype auto|float32|bfloat16] [--device auto|cpu]
                              [--eager] [--max-tokens 16] [--hang-after 280]
"""
import argparse
import faulthandler
import gc
import time

import torch

from nanovllm import LLM, SamplingParams

if __name__ == "__main__":  # the TP workers are spawned: they re-import this module
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--hang-after", type=int, default=280, help="dump the stacks and exit after this many seconds")
    args = p.parse_args()
    faulthandler.dump_traceback_later(args.hang_after, exit=True)
    g = torch.Generator().manual_seed(2)
    lengths = (3, 50, 129, 300, 511, 1000, 1500, 17) if args.device != "cpu" else (3, 50, 129, 17)
    prompts = [torch.randint(0, 150000, (n,), generator=g).tolist() for n in lengths]
    results = []
    for tp in (1, 2):
        t = time.time()
        llm = LLM(args.model, load_format="dummy", max_model_len=2048, gpu_memory_utilization=0.6,
                  cpu_kvcache_space_gib=1, tensor_parallel_size=tp, enforce_eager=args.eager, dtype=args.dtype,
                  device=args.device)
        print(f"TP={tp}: init {time.time() - t:.1f} s", flush=True)
        t = time.time()
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
                           use_tqdm=False)
        print(f"TP={tp}: generate {time.time() - t:.1f} s", flush=True)
        results.append([o.token_ids for o in out])
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"{args.model} {args.dtype}: equal sequences {sum(a == b for a, b in zip(*results))} of {len(prompts)}; "
          "first difference at token", [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                        for a, b in zip(*results)])
