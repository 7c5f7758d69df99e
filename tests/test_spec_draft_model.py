"""Speculative decoding with a draft model (speculative_config {"model": ..., "num_speculative_tokens": k}):
greedy outputs equal the plain engine's with the target as its own draft (every draft accepted) and
with a different draft (drafts rejected), through chunked prefill, preemption and n > 1; sampled
drafts drawn with the target's noise (all accepted with the target as its draft, seeded outputs
the plain engine's); sampled tokens keep the target's distribution; a draft of another vocabulary
fails up front."""
import numpy as np
import pytest
import torch
from scipy.stats import chi2

from nanovllm import LLM, SamplingParams
from tests.conftest import COMMON, make_tiny_model, random_prompts
from tests.test_spec_decode import (ARGS, exact_joint, num_accepted, outputs, repetitive_prompts, tf32_greedy,
                                    tiny_vocab_model)


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 40},  # the target's and the draft's prompts in chunks
    {"num_kvcache_blocks": 9, "max_model_len": 128},  # the target preempts
])
def test_greedy_outputs_with_a_draft_model_equal_plain_outputs(tiny_qwen3, tmp_path_factory, engine_args):
    path, _ = tiny_qwen3
    other = make_tiny_model("llama", tmp_path_factory)[0]  # the same vocabulary, other weights
    prompts = repetitive_prompts() + random_prompts([7, 23, 60], seed=3)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2)
    expected = outputs(LLM(path, **ARGS, **engine_args), prompts, params)
    for draft in (path, other):
        spec = LLM(path, **ARGS, **engine_args, speculative_config={"model": draft, "num_speculative_tokens": 3})
        for _ in range(2):  # the second run starts from the draft's pool as the first left it
            assert outputs(spec, prompts, params) == expected
        m, proposer = spec.engine.spec_metrics, spec.engine.speculator.proposer
        assert m.num_drafts > 20
        if draft == path:  # its own draft: every draft right
            assert m.num_accepted_tokens == m.num_draft_tokens
        else:
            assert m.num_accepted_tokens < m.num_draft_tokens / 2
        if "num_kvcache_blocks" in engine_args:
            assert spec.engine.scheduler.num_preemptions > 0
        assert proposer.block_manager.num_free_blocks == proposer.runner.num_kvcache_blocks  # shadows freed
        assert spec.engine.block_manager.num_free_blocks == spec.engine.model_runner.num_kvcache_blocks


def test_sequences_that_do_not_fit_the_draft_pool_go_without_drafts(tiny_qwen3, monkeypatch):
    from nanovllm.engine.spec_decode import draft_model
    monkeypatch.setattr(draft_model, "DRAFT_POOL_TOKENS", 1)  # the pool holds one max_model_len sequence
    path, _ = tiny_qwen3
    prompts, params = repetitive_prompts(), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    args = ARGS | {"max_model_len": 128}
    spec = LLM(path, **args, speculative_config={"model": path, "num_speculative_tokens": 3})
    assert spec.engine.speculator.proposer.runner.num_kvcache_blocks == 8
    assert outputs(spec, prompts, params) == outputs(LLM(path, **args), prompts, params)
    m = spec.engine.spec_metrics
    assert 0 < m.num_drafts < 30 * len(prompts) / 4 and m.num_accepted_tokens == m.num_draft_tokens


@pytest.mark.parametrize("seeded", [True, False])
def test_sampled_drafts_share_the_targets_noise(tiny_qwen3, seeded):
    """Sampled completions (temperature, top_p, top_k) with the target as its own draft: the drafts
    are drawn with the noise the target draws each position with, so every one is accepted, and
    seeded completions are the plain engine's token for token (an argmax draft would be accepted
    only where the target's draw is its argmax)."""
    path, _ = tiny_qwen3
    prompts = repetitive_prompts() + random_prompts([7, 23, 60], seed=4)
    params = [SamplingParams(temperature=t, top_p=0.9, top_k=k, max_tokens=24, ignore_eos=True,
                             seed=100 + i if seeded else None, n=2)
              for i, (t, k) in enumerate(zip((0.7, 1.0, 1.3, 0.9, 1.0, 2.0), (0, 50, 0, 0, 20, 0)))]
    spec = LLM(path, **ARGS, speculative_config={"model": path, "num_speculative_tokens": 3})
    got = outputs(spec, prompts, params)
    m = spec.engine.spec_metrics
    assert m.num_drafts > 30 and m.num_accepted_tokens == m.num_draft_tokens
    if seeded:
        assert got == outputs(LLM(path, **ARGS), prompts, params)
    else:  # the engine's seeds differ from completion to completion
        completions = [tuple(c[0]) for o in got for c in o]
        assert len(set(completions)) == len(completions)


def test_sampled_tokens_with_a_draft_model_keep_the_target_distribution(tmp_path):
    """As test_spec_decode's chi-square test, with a draft model of other weights drawing its drafts
    with the target's noise."""
    vocab, depth, num = 4, 3, 3000
    path, model = tiny_vocab_model(tmp_path / "target", vocab)
    draft, _ = tiny_vocab_model(tmp_path / "draft", vocab, seed=6)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 3, 2, 0, 1]
    expected = exact_joint(model, prompt, vocab, depth) * num
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=6, ignore_eos=True) for i in range(num)]
    llm = LLM(path, **ARGS, max_num_seqs=512, speculative_config={"model": draft, "num_speculative_tokens": 2,
                                                                  "disable_by_batch_size": None})
    counts = np.zeros(vocab ** depth)
    for out in llm.generate([prompt] * num, params, use_tqdm=False):
        counts[np.ravel_multi_index(out.outputs[0].token_ids[:depth], (vocab,) * depth)] += 1
    small = expected < 5
    obs, exp = np.append(counts[~small], counts[small].sum()), np.append(expected[~small], expected[small].sum())
    assert chi2.sf(((obs - exp) ** 2 / exp).sum(), len(obs) - 1) > 1e-3
    assert 200 < num_accepted(llm) < llm.engine.spec_metrics.num_draft_tokens


def test_a_draft_model_of_another_vocabulary_fails_up_front(tiny_qwen3, tmp_path):
    path, _ = tiny_qwen3
    draft, _ = tiny_vocab_model(tmp_path, 4)
    with pytest.raises(ValueError, match="a draft model must share the target's"):
        LLM(path, **ARGS, speculative_config={"model": draft, "num_speculative_tokens": 2})


def test_a_missing_draft_model_is_named_as_the_draft(tiny_qwen3, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"speculative_config model '{tmp_path}/none': .*does not exist"):
        LLM(tiny_qwen3[0], **ARGS, speculative_config={"model": str(tmp_path / "none"), "num_speculative_tokens": 2})


def test_a_draft_model_of_fewer_positions_than_max_model_len_fails_up_front(tiny_qwen3, tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    path, _ = tiny_qwen3
    short = {**COMMON, "head_dim": 16, "max_position_embeddings": 64}
    Qwen3ForCausalLM(Qwen3Config(**short)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="max_model_len=128 exceeds the draft model's max_position_embeddings=64"):
        LLM(path, **ARGS, max_model_len=128, speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2})


def test_a_draft_model_beside_a_tensor_parallel_target(tiny_qwen3):
    """The draft runs whole on rank 0 (its proposals are rank 0's host's), the target on two ranks:
    greedy outputs equal the plain engine's, and the target as its own draft has every draft accepted."""
    path, _ = tiny_qwen3
    prompts = repetitive_prompts() + random_prompts([9, 30], seed=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    args = ARGS | dict(max_model_len=128, max_num_batched_tokens=48)
    spec = LLM(path, **args, tensor_parallel_size=2, speculative_config={"model": path, "num_speculative_tokens": 3})
    assert outputs(spec, prompts, params) == outputs(LLM(path, **args), prompts, params)
    m = spec.engine.spec_metrics
    assert m.num_accepted_tokens == m.num_draft_tokens > 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_draft_model_under_cuda_graphs(tiny_qwen3):
    """The draft's own steps replay its q_len 1 graphs and its greedy chains' graphs, the target's
    verify steps its q_len 1 + k ones; the tokens are greedy up to TF32 near-ties; the draft's
    pool is sized before the target's."""
    path, hf_model = tiny_qwen3
    args = dict(device="cuda", dtype="float32", max_model_len=256, gpu_memory_utilization=0.3, kvcache_block_size=16)
    prompts = repetitive_prompts() + random_prompts([9, 30], seed=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec = LLM(path, **args, speculative_config={"model": path, "num_speculative_tokens": 3})
    proposer = spec.engine.speculator.proposer
    assert proposer.runner.graph_runner.chains and (1, 4) in spec.engine.model_runner.graph_runner.graphs
    ours = outputs(spec, prompts, params)
    assert all(tf32_greedy(hf_model, p, o[0][0]) for p, o in zip(prompts, ours))
    m = spec.engine.spec_metrics
    assert m.num_accepted_tokens > 0.8 * m.num_draft_tokens  # its own draft: right but for near-ties
