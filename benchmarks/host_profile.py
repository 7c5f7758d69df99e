"""Where one sequence's decode time goes on the host: one generate of 512 tokens after a 128-token
prompt (dummy weights), timed, then again under cProfile, plain and with synthetic speculation
(replayed drafts accepted with probability 0.7, k = 4, as bench.py's replay). Prints ms/token
unprofiled and the functions by own time and by cumulative time. A speculative step cannot
overlap the next one, so its host work adds to the GPU's; a plain step hides its own behind the
GPU's unless the host is slower (docs/perf-log.md, 2026-11-27).

    python benchmarks/host_profile.py [--model Qwen/Qwen3-0.6B] [--rows 22]
"""
import argparse
import cProfile
import gc
import pstats
import time

import torch

from nanovllm import LLM, SamplingParams

REPLAY = {"method": "replay", "acceptance_rate": 0.7, "num_speculative_tokens": 4}
ENGINE = r"nanovllm.*(step|_process|propose|schedule|run|execute|plan_step|replay|upload|prepare|_accept_runs|" \
         r"_after_launch|build_metadata|host_arrays|sampler|read_tokens)"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen/Qwen3-0.6B")
    p.add_argument("--rows", type=int, default=22, help="functions listed by own time")
    args = p.parse_args()
    prompt = torch.randint(0, 150000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
    for spec in (None, REPLAY):
        llm = LLM(args.model, load_format="dummy", max_model_len=1024, gpu_memory_utilization=0.5,
                  speculative_config=spec)
        llm.generate([prompt], params, use_tqdm=False)  # warms up; with replay, records the greedy run
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        print(f"{'replay' if spec else 'plain'}: {(time.perf_counter() - start) * 1e3 / 512:.3f} ms/token unprofiled")
        profile = cProfile.Profile()
        profile.enable()
        llm.generate([prompt], params, use_tqdm=False)
        profile.disable()
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(args.rows)
        stats.sort_stats("cumulative").print_stats(ENGINE, 30)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
