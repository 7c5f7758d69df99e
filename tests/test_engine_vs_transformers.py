"""Greedy tokens of the engine equal transformers' on tiny random Qwen3, Qwen2 and Llama models."""
import pytest

from nanovllm import LLM, SamplingParams
from tests.conftest import hf_greedy, needs_interpreter, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LENGTHS = [1, 7, 16, 17, 40, 95]


def check_against_hf(llm, hf_model, prompts, max_tokens=12):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(hf_model, prompt, max_tokens)
        assert out.finish_reason == "length"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.model_runner.num_kvcache_blocks
    return outs


def test_batch_of_mixed_lengths(tiny_model):
    path, hf_model = tiny_model
    llm = LLM(path, kvcache_block_size=16, device="cpu")
    outs = check_against_hf(llm, hf_model, random_prompts(LENGTHS))
    assert len({tuple(o.token_ids) for o in outs}) > 1  # the model is not degenerate


@needs_interpreter
@pytest.mark.parametrize("decode_programs_from", [None, 1])
def test_triton_backend_in_the_interpreter(tiny_model, decode_programs_from, monkeypatch):
    """The Triton kernels (fused norm + rope + K/V store, paged prefill and decode attention) through
    the whole engine, with chunked prefill and a prefix hit, in Triton's interpreter on CPU; with
    decode_programs_from 1, mixed steps give their decoding sequences decode programs."""
    from nanovllm.layers.attention import triton_backend
    if decode_programs_from is not None:
        monkeypatch.setattr(triton_backend, "DECODE_PROGRAMS_FROM", decode_programs_from)
    seen, prefill_attention = [], triton_backend.prefill_attention
    monkeypatch.setattr(triton_backend, "prefill_attention",
                        lambda *a, num_decodes=0, **kw: seen.append(num_decodes) or prefill_attention(
                            *a, num_decodes=num_decodes, **kw))
    path, hf_model = tiny_model
    llm = LLM(path, kvcache_block_size=16, max_num_batched_tokens=24, attention_backend="triton", device="cpu")
    assert llm.engine.model_runner.backend.name == "triton"
    shared = random_prompts([33], seed=5)[0]
    check_against_hf(llm, hf_model, [shared + [1], *random_prompts([5, 40], seed=6)])
    assert check_against_hf(llm, hf_model, [shared + [2, 3]])[0].num_cached_tokens == 32
    assert (max(seen) > 0) == (decode_programs_from is not None)  # mixed steps with decoding sequences ran


def test_step_inputs_upload_aligned(tiny_qwen3):
    """A step's index arrays go to the device packed into one buffer; each must come back intact, in
    its dtype, and start 16-byte aligned (Triton compiles a new kernel variant for unaligned pointers)."""
    import numpy as np
    import torch
    llm = LLM(tiny_qwen3[0], kvcache_block_size=16, device="cpu")
    arrays = [np.arange(5), np.arange(12).reshape(3, 4) - 7, np.zeros((0, 2), np.int64), np.array([9])]
    dtypes = [torch.int32, torch.int64, torch.int32, torch.int32]
    out = llm.engine.model_runner.stager.upload(arrays, dtypes)
    assert [o.dtype for o in out] == dtypes and [tuple(o.shape) for o in out] == [a.shape for a in arrays]
    assert all((o.numpy() == a).all() for o, a in zip(out, arrays))
    assert all(o.data_ptr() % 16 == 0 for o in out)


def test_chunked_prefill(tiny_any_model):
    path, hf_model = tiny_any_model
    llm = LLM(path, kvcache_block_size=16, max_num_batched_tokens=24, device="cpu")
    check_against_hf(llm, hf_model, random_prompts(LENGTHS, seed=1))


def test_prefix_cache_hits(tiny_any_model):
    path, hf_model = tiny_any_model
    llm = LLM(path, kvcache_block_size=16, device="cpu")
    shared = random_prompts([70], seed=2)[0]
    tails = random_prompts([3, 9, 20], seed=3)
    prompts = [shared + t for t in tails]
    check_against_hf(llm, hf_model, prompts[:1])
    outs = check_against_hf(llm, hf_model, prompts[1:])  # a second call: the shared prefix is cached
    assert [o.num_cached_tokens for o in outs] == [64, 64]  # 4 full blocks of the 70-token prefix reused
    again = check_against_hf(llm, hf_model, prompts[:1])
    assert again[0].num_cached_tokens == 64
    assert llm.reset_prefix_cache()
    assert check_against_hf(llm, hf_model, prompts[:1])[0].num_cached_tokens == 0


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_a_request_that_ends_at_once_leaves_its_prompt_cached(tiny_qwen3, max_tokens):
    """A request of one or two tokens (a classification's) ends before any step after its prompt's
    is read back; its prompt's full blocks still go to the prefix cache, and the next request with
    the same prefix finds them (and its tokens are transformers')."""
    path, hf_model = tiny_qwen3
    llm = LLM(path, kvcache_block_size=16, device="cpu")
    shared = random_prompts([40], seed=12)[0]
    first = check_against_hf(llm, hf_model, [shared + [1]], max_tokens)
    second = check_against_hf(llm, hf_model, [shared + [2]], max_tokens)
    assert (first[0].num_cached_tokens, second[0].num_cached_tokens) == (0, 32)


def test_a_stop_in_the_last_token_ends_a_request_ended_at_its_length(tiny_qwen3):
    """A request ends at its length when its last step launches; that step's token, read back,
    may be a stop as well: the stop is its reason then, and its blocks are freed once."""
    path, hf_model = tiny_qwen3
    llm = LLM(path, kvcache_block_size=16, device="cpu")
    prompt = random_prompts([40], seed=13)[0]
    greedy = hf_greedy(hf_model, prompt, 6)
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[greedy[5]], ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert greedy[5] not in greedy[:5]  # the stop comes at the last token, not before
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (greedy, "stop", greedy[5])
    assert llm.engine.block_manager.num_free_blocks == llm.engine.model_runner.num_kvcache_blocks
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 32


def test_preemption(tiny_model):
    path, hf_model = tiny_model
    # 8 blocks of 16 tokens: each sequence needs up to 7 blocks, so running them together preempts
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=112, device="cpu")
    check_against_hf(llm, hf_model, random_prompts([50, 45, 60, 30], seed=4), max_tokens=40)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_with_chunks_and_shared_prefixes(tiny_qwen3, prefix_caching):
    path, hf_model = tiny_qwen3
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=9, max_model_len=128, max_num_batched_tokens=20,
              enable_prefix_caching=prefix_caching, device="cpu")
    shared = random_prompts([40], seed=5)[0]
    prompts = [shared + t for t in random_prompts([5, 25, 1, 12], seed=6)]
    check_against_hf(llm, hf_model, prompts, max_tokens=30)
    assert llm.engine.scheduler.num_preemptions > 0


def test_profiler_regions(tiny_qwen3):
    """Under torch.profiler a step's named regions (engine/trace.py) are recorded; outside one no
    record_function is entered (it costs ~18 us a use), and either way the tokens are the same."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    from nanovllm.engine.trace import region
    assert isinstance(region("forward"), contextlib.nullcontext)
    llm = LLM(tiny_qwen3[0], kvcache_block_size=16, device="cpu")
    prompts = random_prompts([9, 20], seed=3)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = llm.generate(prompts, GREEDY, use_tqdm=False)
    names = {event.name for event in prof.events()}
    assert {"scheduling", "prepare_inputs", "forward", "compute_logits", "sampling"} <= names, names
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == [o.token_ids for o in profiled]


def test_without_triton(tiny_qwen3, tmp_path):
    """README's first command installs the CPU build of torch, which brings no Triton: the engine must
    import and run on the torch backend without it (a module-level `import triton` on the engine's
    import path once broke `python example.py` there while the tests, with Triton, passed)."""
    import os
    import subprocess
    import sys
    path, hf_model = tiny_qwen3
    prompt = random_prompts([9], seed=3)[0]
    script = tmp_path / "no_triton.py"
    script.write_text(f"""
import sys
sys.modules["triton"] = None  # `import triton` raises and find_spec("triton") is None, as where it is not installed
from nanovllm import LLM, SamplingParams
llm = LLM({path!r}, device="cpu")
out = llm.generate([{prompt!r}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
print(llm.engine.model_runner.backend.name, out[0].token_ids)
""")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == f"torch {hf_greedy(hf_model, prompt, 6)}"
