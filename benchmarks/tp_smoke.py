"""Tensor-parallel smoke run with timings: dummy Qwen3-8B greedy tokens at TP=1 and TP=2 (bf16
unless --float32), how many sequences agree and where the first differ.
python benchmarks/tp_smoke.py [--eager] [--float32] [faulthandler seconds]"""
import faulthandler
import gc
import sys
import time

import torch

from nanovllm import LLM, SamplingParams

if __name__ == "__main__":  # the TP workers are spawned: they re-import this module
    faulthandler.dump_traceback_later(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 280, exit=True)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 150000, (n,), generator=g).tolist() for n in (3, 50, 129, 300, 511, 1000, 1500, 17)]
    results = []
    for tp in (1, 2):
        t = time.time()
        llm = LLM("Qwen/Qwen3-8B", load_format="dummy", max_model_len=2048, gpu_memory_utilization=0.6,
                  tensor_parallel_size=tp, enforce_eager="--eager" in sys.argv,
                  dtype="float32" if "--float32" in sys.argv else "auto")
        print(f"TP={tp}: init {time.time() - t:.1f} s", flush=True)
        t = time.time()
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        print(f"TP={tp}: generate {time.time() - t:.1f} s", flush=True)
        results.append([o.token_ids for o in out])
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    print("equal sequences:", sum(a == b for a, b in zip(*results)), "of", len(prompts), "; first difference at "
          "token", [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(*results)])
