"""GPU engine checks (skipped without CUDA): Qwen3-0.6B's shape with random bf16 weights against
transformers' greedy tokens, with CUDA graphs on and off, prefix hits and chunked prefill; the
Triton and torch attention backends agree; the float8 KV cache and float8 weights through the same paths."""
import pytest
import torch

from tests.conftest import cuda_random_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NUM_TOKENS = 16


@pytest.fixture(scope="module")
def qwen3_06b(tmp_path_factory):
    from transformers import Qwen3ForCausalLM
    return cuda_random_model("qwen3-0.6b", Qwen3ForCausalLM, tmp_path_factory)


def logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids], device="cuda")).logits[0].float()


def prompts():
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 150000, (300,), generator=g).tolist()
    lengths = [5, 64, 129, 256, 300, 511, 700, 1000]
    plain = [torch.randint(0, 150000, (n,), generator=g).tolist() for n in lengths]
    return plain + [shared + torch.randint(0, 150000, (n,), generator=g).tolist() for n in (1, 40, 260)]


def hf_greedy(model, prompt):
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS,
                             min_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("engine_args,decode_programs_from", [
    (dict(), None),
    (dict(enforce_eager=True), None),
    (dict(max_num_batched_tokens=512, kvcache_block_size=16), None),
    (dict(max_num_batched_tokens=512, kvcache_block_size=16), 1),  # mixed steps' decoding rows: decode programs
    (dict(attention_backend="torch", enforce_eager=True), None),
], ids=["graphs", "eager", "chunked-block16", "chunked-decode-programs", "torch-backend"])
def test_greedy_matches_transformers(qwen3_06b, engine_args, decode_programs_from, monkeypatch):
    from nanovllm import LLM, SamplingParams
    from nanovllm.layers.attention import triton_backend
    if decode_programs_from is not None:
        monkeypatch.setattr(triton_backend, "DECODE_PROGRAMS_FROM", decode_programs_from)
    path, hf_model, exact_model = qwen3_06b
    llm = LLM(path, max_model_len=2048, gpu_memory_utilization=0.5, **engine_args)
    ps = prompts()
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    llm.generate(ps[-3:-2], params, use_tqdm=False)
    outs = llm.generate(ps[-2:], params, use_tqdm=False)  # the shared prefix is cached now ...
    assert all(o.num_cached_tokens > 0 for o in outs)
    outs = llm.generate(ps, params, use_tqdm=False)  # ... and a mixed batch with hits
    # Random weights give near-ties (top logits ~2.7 apart by ~0.01) where two correct bf16
    # implementations may choose differently, so each token is checked against the float32 model:
    # it must be the float32 argmax up to twice the error bf16 itself makes there (transformers'
    # bf16 logits against its float32 logits, same tokens; our error and its error).
    exact = 0
    for i, (p, o) in enumerate(zip(ps, outs)):
        exact += o.token_ids == hf_greedy(hf_model, p)
        ids, n = p + o.token_ids, len(p)
        true, bf16 = logits(exact_model, ids)[n - 1:-1], logits(hf_model, ids)[n - 1:-1]
        noise = (bf16 - true).abs().amax(-1)
        gap = true.amax(-1) - true.gather(1, torch.tensor(o.token_ids, device="cuda")[:, None])[:, 0]
        assert (gap <= 2 * noise).all(), (i, gap.tolist(), noise.tolist())
    print(f"{engine_args}: {exact}/{len(ps)} sequences equal transformers' generate token for token")
    assert exact >= len(ps) // 2
    assert llm.engine.block_manager.num_free_blocks == llm.engine.model_runner.num_kvcache_blocks


def test_too_little_gpu_memory_says_what_to_change():
    import gc

    from nanovllm import LLM
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    in_use = total - free
    with pytest.raises(MemoryError, match=r"the weights need 1\.1\d GiB .*raise gpu_memory_utilization"):
        LLM("Qwen/Qwen3-0.6B", load_format="dummy", gpu_memory_utilization=(in_use + 2**29) / total)
    # room for the weights (1.11 GiB) and the warm-up, not for one 40,960-token sequence (4.4 GiB of KV):
    # an explicit max_model_len is refused, the model's default is lowered to what the pool holds
    utilization = (in_use + 3 * 2**30) / total
    with pytest.raises(ValueError, match=r"one sequence of max_model_len=40960 needs .*raise gpu_memory_utilization "
                                         r"or lower max_model_len \(or set num_kvcache_blocks\)"):
        LLM("Qwen/Qwen3-0.6B", load_format="dummy", gpu_memory_utilization=utilization, max_model_len=40960,
            enforce_eager=True)
    # 5 GiB: the weights, the warm-up's peak (~2 GiB at 40,960 tokens) and a pool of less than 4.4 GiB
    llm = LLM("Qwen/Qwen3-0.6B", load_format="dummy", gpu_memory_utilization=(in_use + 5 * 2**30) / total,
              enforce_eager=True)
    assert 0 < llm.engine.config.max_model_len < 40960


def test_seeded_sampling_and_logprobs_on_the_gpu(qwen3_06b):
    """Seeded requests repeat on the Gumbel-max kernel and on the top-k path, and different seeds
    differ; raw logprobs equal transformers' log-softmax. (That a seed draws the same token on
    every path given the same logits is test_sampler's; across batches of different sizes bf16
    logits may differ in their last bits, so a near tie may go either way.)"""
    from nanovllm import LLM, SamplingParams
    path, model, _ = qwen3_06b
    llm = LLM(path, max_model_len=2048)
    prompt = prompts()[1]
    for extra in (dict(logprobs=2), dict(top_k=50, top_p=0.9)):
        runs = [llm.generate([prompt], SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True, **extra),
                             use_tqdm=False)[0].outputs[0] for seed in (11, 11, 12)]
        assert runs[0].token_ids == runs[1].token_ids != runs[2].token_ids, extra
        if "logprobs" in extra:
            ref = logits(model, prompt + runs[0].token_ids)[len(prompt) - 1:-1].log_softmax(-1)
            for step, token, lp in zip(runs[0].logprobs, runs[0].token_ids, ref):
                assert step[token].logprob == pytest.approx(lp[token].item(), abs=0.05)  # bf16: 2^-8 of |logprob| ~ 12


@pytest.mark.parametrize("fp8, reference_args, max_gap", [
    (dict(kv_cache_dtype="fp8"), dict(attention_backend="torch", enforce_eager=True), 0.5),
    # a staging area of 512 / 16 + 4 blocks: the later chunks' prefill attention reads the float8 cache
    (dict(kv_cache_dtype="fp8", max_num_seqs=4), dict(attention_backend="torch", enforce_eager=True), 0.5),
    (dict(quantization="fp8"), dict(enforce_eager=True), 1.0),
], ids=["kv_cache_dtype", "kv_cache_dtype-staging-overflows", "quantization"])
def test_fp8_on_the_gpu(qwen3_06b, fp8, reference_args, max_gap):
    """The float8 KV cache, and float8 weights, through the Triton kernels with CUDA graphs, chunked
    prefill, 16-token blocks and prefix hits (prefill attention over the blocks staged in the model
    dtype, or, past the staging area, the float8 cache), against a reference engine of the same precision:
    for the cache the torch backend (eager; float32 attention over the same float8 cache, which
    both write alike: test_fused_kernels), for the weights the same engine eager (the same fp8
    GEMMs). Every token is close to the float32 model's argmax, and where a sequence first
    parts from the reference's, the float32 model finds the two tokens nearly tied (wrong
    scales, a transposed operand or a stale graph buffer give arbitrary tokens, several logits
    below it). How many sequences equal token for token is printed, not asserted: with random
    weights near-ties are common, and any change of rounding (a norm, a GEMM's tiling) moves
    that count (3-7 of 11 in past runs)."""
    import gc

    from nanovllm import LLM, SamplingParams
    path, _, exact_model = qwen3_06b
    ps = prompts()
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    runs = []
    for args in (dict(kvcache_block_size=16, max_num_batched_tokens=512), reference_args):
        llm = LLM(path, max_model_len=2048, gpu_memory_utilization=0.5, **fp8, **args)
        llm.generate(ps[-3:-2], params, use_tqdm=False)
        runs.append(llm.generate(ps, params, use_tqdm=False))
        assert all(o.num_cached_tokens > 0 for o in runs[-1][-2:])
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    equal = sum(a.token_ids == b.token_ids for a, b in zip(*runs))
    gaps, ties = [], []
    for p, a, b in zip(ps, *runs):
        true = logits(exact_model, p + a.token_ids)[len(p) - 1:-1]
        gaps.append((true.amax(-1) - true.gather(1, torch.tensor(a.token_ids, device="cuda")[:, None])[:, 0]).max().item())
        parted = [i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y][:1]
        ties += [abs(true[i, a.token_ids[i]] - true[i, b.token_ids[i]]).item() for i in parted]
    print(f"{fp8}: {equal}/{len(ps)} sequences equal the reference engine's; largest gap to the float32 argmax "
          f"{max(gaps):.3f}; float32 logit gaps where they part {[round(t, 3) for t in ties]}")
    assert max(gaps) < max_gap and max(ties, default=0) < max_gap, (gaps, ties)


@pytest.mark.parametrize("m", [1, 7, 16, 17, 256, 1000])
def test_fp8_linear_on_the_gpu(m):
    """fp8_linear on CUDA at Qwen3-0.6B's gate_up shape, both paths: up to MAX_W8A16_ROWS rows the
    Triton kernel with bf16 activations, equal to x times the dequantized weights in float64;
    above, torch._scaled_mm with row-wise scales, equal to the same quantized operands in
    float64 (both to the bf16 output's rounding, 2^-8); and both within e4m3's error bound of the
    unquantized product (test_fp8_weights._bound)."""
    from nanovllm.kernels.fp8 import MAX_W8A16_ROWS, fp8_linear, quantize_fp8
    from tests.test_fp8_weights import _bound
    g = torch.Generator("cuda").manual_seed(m)
    x = (torch.randn(m, 1024, device="cuda", generator=g) * torch.logspace(-2, 1, 1024, device="cuda")).bfloat16()
    w = torch.randn(6144, 1024, device="cuda", generator=g, dtype=torch.float64) * 0.02
    qw, sw = quantize_fp8(w)
    y = fp8_linear(x, qw, sw)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 6144)
    qx, sx = quantize_fp8(x)
    deq_x = x.double() if m <= MAX_W8A16_ROWS else qx.double() * sx.double()[:, None]
    same = deq_x @ (qw.double() * sw.double()[:, None]).t()
    assert torch.allclose(y.double(), same, rtol=2**-8, atol=2**-8 * same.abs().max().item())
    exact = x.double() @ w.t()
    assert ((y.double() - exact).abs() <= _bound(x.double(), sx.double(), w, sw.double()) + 2**-8 * exact.abs()).all()


def test_penalties_on_the_gpu(qwen3_06b):
    """Penalised greedy requests through the penalty kernel and the token counts kept on the device,
    beside plain ones in CUDA-graph decode steps: each token within bf16's reach of the argmax of
    the float32 model's logits penalised as apply_penalties defines (over the tokens the engine
    produced), and the penalties change the completions."""
    from nanovllm import LLM, SamplingParams
    path, _, exact_model = qwen3_06b
    ps = prompts()[:6]
    base = dict(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    pen = [dict(repetition_penalty=1.5), dict(presence_penalty=2.0, frequency_penalty=1.0)]
    params = [SamplingParams(**base, **pen[i % 2]) if i < 4 else SamplingParams(**base) for i in range(len(ps))]
    llm = LLM(path, max_model_len=2048, gpu_memory_utilization=0.5)
    outs = llm.generate(ps, params, use_tqdm=False)
    plain = llm.generate(ps[:4], SamplingParams(**base), use_tqdm=False)
    assert any(a.token_ids != b.token_ids for a, b in zip(outs, plain))
    for i, (p, o) in enumerate(zip(ps[:4], outs)):
        x = logits(exact_model, p + o.token_ids)[len(p) - 1:-1]
        for t, row in enumerate(x):
            done = torch.tensor(o.token_ids[:t], dtype=torch.long, device="cuda")
            counts = torch.bincount(done, minlength=row.numel()).float()
            if i % 2 == 0:
                seen = (counts > 0) | (torch.bincount(torch.tensor(p, device="cuda"), minlength=row.numel()) > 0)
                row = torch.where(seen, torch.where(row > 0, row / 1.5, row * 1.5), row)
            else:
                row = row - 1.0 * counts - 2.0 * (counts > 0)
            assert row.max() - row[o.token_ids[t]] < 0.5, (i, t)  # as test_fp8_on_the_gpu's bf16 gap
