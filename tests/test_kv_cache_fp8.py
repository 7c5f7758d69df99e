"""The float8 KV cache (kv_cache_dtype="fp8") through the whole engine on CPU: its pool size, and
the same greedy tokens whatever the scheduling (chunks, prefix hits, preemption, forks) and
whichever backend (the Triton kernels in Triton's interpreter). Its accuracy on real weights is
in test_real_weights.py."""
import pytest

from nanovllm import LLM, SamplingParams
from tests.conftest import needs_interpreter, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


def test_the_fp8_pool_holds_more_tokens(tiny_qwen3):
    path, hf_model = tiny_qwen3
    head_dim = hf_model.config.head_dim
    pools = [LLM(path, device="cpu", kvcache_block_size=16, cpu_kvcache_space_gib=0.001, kv_cache_dtype=dtype)
             for dtype in ("auto", "fp8_e4m3")]
    blocks = [llm.engine.model_runner.num_kvcache_blocks for llm in pools]
    # float32 model: 4 bytes per value against 1, plus a 4-byte scale per head vector
    assert blocks[1] == int(0.001 * 2**30) // (2 * 2 * 2 * 16 * (head_dim + 4))
    assert blocks[1] / blocks[0] == pytest.approx(4 * head_dim / (head_dim + 4), rel=0.01)
    assert pools[1].engine.model_runner.kv_cache.scales.shape == (2, 2, blocks[1], 16, 2)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter),
                                     pytest.param("triton-decode-programs", marks=needs_interpreter)])
def test_fp8_tokens_do_not_depend_on_scheduling(tiny_qwen3, backend, monkeypatch):
    """Each prompt alone in a roomy engine gives the reference; then all together through chunked
    prefill (20-token budget), prefix-cache hits, preemption (9 blocks) and n=2 (the shared partial
    block copied with its scales) must give the same tokens. The Triton backend must give the
    torch backend's reference tokens; "triton-decode-programs" also gives mixed steps' decoding
    sequences decode programs in prefill attention, and decode steps their float8 store outside the
    decode kernel. The Triton backend's prefill steps read their blocks dequantized into the
    staging area. (Against the float32 cache these tiny random models part after a few tokens,
    from near-ties of their logits; accuracy is measured on real weights.)"""
    staged = []  # blocks per dequantize_blocks call
    if backend != "torch":
        from nanovllm.layers.attention import triton_backend
        if backend == "triton-decode-programs":
            monkeypatch.setattr(triton_backend, "DECODE_PROGRAMS_FROM", 1)
            monkeypatch.setattr(triton_backend, "FUSED_FP8_MAX_SEQS", 0)
        dequantize_blocks = triton_backend.dequantize_blocks
        monkeypatch.setattr(triton_backend, "dequantize_blocks",
                            lambda *args: staged.append(args[3].numel()) or dequantize_blocks(*args))
        backend = "triton"
    path, _ = tiny_qwen3
    shared = random_prompts([40], seed=5)[0]
    prompts = [shared + t for t in random_prompts([5, 25, 1, 12], seed=6)]
    roomy = LLM(path, device="cpu", kvcache_block_size=16, kv_cache_dtype="fp8", enable_prefix_caching=False)
    reference = [roomy.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    tight = LLM(path, device="cpu", kvcache_block_size=16, kv_cache_dtype="fp8", attention_backend=backend,
                num_kvcache_blocks=9, max_model_len=128, max_num_batched_tokens=20)
    outs = tight.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert tight.engine.scheduler.num_preemptions > 0 and any(o.num_cached_tokens for o in outs)
    assert (backend == "torch") == (not staged)
    forked = tight.generate(prompts[:2], SamplingParams(n=2, temperature=0, max_tokens=30, ignore_eos=True),
                            use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in forked] == [[r, r] for r in reference[:2]]
