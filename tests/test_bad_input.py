"""Bad input gets a clear error before any work, and the same LLM serves the next valid call."""
import json
import os
from dataclasses import replace

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.conftest import VOCAB, hf_greedy, random_prompts


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(tiny_qwen3[0], kvcache_block_size=16, max_model_len=64, device="cpu")


def still_works(llm, hf_model):
    prompt = random_prompts([9], seed=11)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert out[0].token_ids == hf_greedy(hf_model, prompt, 5)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.model_runner.num_kvcache_blocks
    assert llm.engine.scheduler.is_finished()


@pytest.mark.parametrize("prompts,params,message", [
    ([[1, 2], []], None, "request 1: the prompt is empty"),
    ([[1, VOCAB]], None, "outside the vocabulary"),
    ([[-1, 3]], None, "outside the vocabulary"),
    ([[1] * 65], None, "more than max_model_len=64"),
    (["text"], None, "no tokenizer"),
    ([[1], [2]], [SamplingParams()], "got 1 SamplingParams for 2 prompts"),
    ([1, 2, 3], None, r"prompts must be a string, a .*prompt_token_ids.* dict, or a list of .*pass \[\[1, 2, 3\]\]"),
    ([[1], 5], None, "request 1: a prompt must be a string or a list of ints"),
    ([{"text": "hi"}], None,
     r"request 0: a prompt dict needs \"prompt\" \(text\) or \"prompt_token_ids\", got keys \['text'\]"),
    ([{"prompt_token_ids": [1, 2], "multi_modal_data": {"image": "x"}}], None,
     r"request 0: prompt dict key\(s\) \['multi_modal_data'\]: multimodal input is not supported"),
    ([{"prompt_token_ids": [1, 2], "cache_salt": "a"}], None,
     r"prompt dict key\(s\) \['cache_salt'\]: a prompt dict takes only"),
    ([[1, True]], None, "prompt token 1 is True, not an integer token id"),
    ([[1, 2.0]], None, "prompt token 1 is 2.0, not an integer token id"),
    ([[1, 2]], SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids .* outside the vocabulary"),
    ([[1, 2]], SamplingParams(logit_bias={VOCAB + 3: 1.0}), "logit_bias token ids .* outside the vocabulary"),
    ([[1, 2]], SamplingParams(stop=["x"]), "need the model's tokenizer"),
    ([[1, 2]], SamplingParams(allowed_token_ids=[5], stop_token_ids=[5], min_tokens=2),
     r"min_tokens=2 masks every one of allowed_token_ids \[5\]"),
    ([[1, 2]], SamplingParams(logprobs=21), r"logprobs=21 is more than max_logprobs=20; raise the engine argument"),
    ([[1, 2]], SamplingParams(prompt_logprobs=50), "prompt_logprobs=50 is more than max_logprobs=20"),
])
def test_bad_prompts(llm, tiny_qwen3, prompts, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    still_works(llm, tiny_qwen3[1])


def test_sampling_params_of_the_wrong_type(llm, tiny_qwen3):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them.*got dict"):
        llm.generate([[1, 2]], {"temperature": 0}, use_tqdm=False)
    still_works(llm, tiny_qwen3[1])


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(temperature=-0.5), r"temperature must be a finite number in \[0, inf\)"),
    (dict(temperature=float("nan")), "temperature must be a finite number.*got nan"),
    (dict(temperature="0.5"), "temperature must be a finite number.*got '0.5'"),
    (dict(top_p=0.0), r"top_p must be a finite number in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be a finite number in \(0, 1\]"),
    (dict(min_p=2.0), r"min_p must be a finite number in \[0, 1\]"),
    (dict(top_k=-3), "top_k must be an integer >= -1"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of non-negative integer token ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of non-negative integer token ids"),
    (dict(seed=2**70), "seed must be an integer in"),
    (dict(n=0), "n must be an integer >= 1"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be a finite number in \(0, inf\)"),
    (dict(presence_penalty=3.0), r"presence_penalty must be a finite number in \[-2, 2\]"),
    (dict(min_tokens=20), "min_tokens must be at most max_tokens=16, got 20"),
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
    (dict(logprobs=-2), r"logprobs must be None, -1 \(the whole vocabulary\) or an integer >= 0"),
    (dict(stop=[""]), "stop must be a non-empty string or a list of them"),
    (dict(logit_bias={1: float("inf")}), "logit_bias must map token ids to finite numbers"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
    (dict(extra_args=["ban"]), "extra_args must be a dict or None"),
])
def test_bad_sampling_params(llm, tiny_qwen3, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    params = SamplingParams()
    for k, v in kwargs.items():  # changed after construction: caught when submitted, naming the request
        setattr(params, k, v)
    with pytest.raises(ValueError, match="request 1: " + message):
        llm.generate([[1, 2], [3, 4]], [SamplingParams(), params], use_tqdm=False)
    still_works(llm, tiny_qwen3[1])


def test_missing_and_non_model_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"), device="cpu")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(tmp_path), device="cpu")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a .gguf model"):
        LLM(str(tmp_path / "notes.txt"), device="cpu")
    with pytest.raises(FileNotFoundError, match="builtin configs"):
        LLM("no-such-model", load_format="dummy", device="cpu")


def test_unsupported_architecture(tmp_path):
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10, "n_embd": 8,
              "n_layer": 1, "n_head": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel.*supported: Qwen3ForCausalLM"):
        LLM(str(tmp_path), device="cpu")


def test_offline_hub_id_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="could not be downloaded from the Hugging Face hub"):
        LLM("nanovllm-tests/not-a-real-model", device="cpu")


def test_bad_engine_arguments(tiny_qwen3):
    path = tiny_qwen3[0]
    for kwargs, message in [(dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
                            (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
                            (dict(dtype="int8"), "dtype must be"),
                            (dict(device="tpu"), "device must be"),
                            (dict(load_format="pickle"), "load_format must be"),
                            (dict(attention_backend="magic"), "attention_backend must be"),
                            (dict(max_model_len=10**6), "exceeds the model's max_position_embeddings"),
                            (dict(kv_cache_dtype="int4"), r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3'\]"),
                            (dict(generation_config="mine"), "generation_config must be one of"),
                            (dict(max_logprobs=-2), "max_logprobs must be an integer >= 0, or -1"),
                            (dict(trust_remote_code="yes"), "trust_remote_code must be True or False"),
                            (dict(num_kvcache_blocks=2, kvcache_block_size=16, max_model_len=64),
                             "raise num_kvcache_blocks")]:
        with pytest.raises(ValueError, match=message):
            LLM(path, **{"device": "cpu", **kwargs})
    assert os.path.isdir(path)


def test_torch_dtypes_name_the_dtype(tiny_qwen3):
    """vLLM takes dtype=torch.float16 as well as "float16"."""
    from nanovllm.engine_args import EngineArgs
    args = EngineArgs(model=tiny_qwen3[0], dtype=torch.bfloat16, kv_cache_dtype=torch.float8_e4m3fn)
    args.validate()
    assert (args.dtype, args.kv_cache_dtype) == ("bfloat16", "fp8")
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineArgs(model=tiny_qwen3[0], dtype=torch.int8).validate()


def test_trust_remote_code_reaches_transformers(tiny_qwen3, monkeypatch):
    """vLLM's trust_remote_code is accepted and passed to transformers' config loading."""
    from nanovllm.loader import source
    seen, from_pretrained = [], source.AutoConfig.from_pretrained
    monkeypatch.setattr(source.AutoConfig, "from_pretrained",
                        lambda *a, **kw: seen.append(kw.get("trust_remote_code")) or from_pretrained(*a, **kw))
    llm = LLM(tiny_qwen3[0], device="cpu", trust_remote_code=True, kvcache_block_size=16, max_model_len=64)
    assert seen == [True] and llm.config.trust_remote_code
    still_works(llm, tiny_qwen3[1])


def test_max_logprobs_minus_one_lifts_the_limit(tiny_qwen3):
    llm = LLM(tiny_qwen3[0], device="cpu", max_logprobs=-1, kvcache_block_size=16, max_model_len=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=25), use_tqdm=False)[0].outputs[0]
    assert all(len(d) in (25, 26) for d in out.logprobs)  # the top 25, and the sampled token when not among them


def test_default_max_model_len_is_lowered_to_the_kv_cache(tiny_qwen3, caplog):
    """max_model_len left unset: the model's 512 does not fit 2 blocks of 16, so it becomes 32 (logged);
    an explicit max_model_len that does not fit still fails (test_bad_engine_arguments)."""
    llm = LLM(tiny_qwen3[0], device="cpu", num_kvcache_blocks=2, kvcache_block_size=16)
    assert llm.config.max_model_len == 32 and "max_model_len lowered from the model's 512 to 32" in caplog.text
    with pytest.raises(ValueError, match="more than max_model_len=32"):
        llm.generate([[1] * 33], use_tqdm=False)
    out = llm.generate([[1] * 30], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"


def test_stop_conditions(llm, tiny_qwen3):
    prompt = random_prompts([6], seed=12)[0]
    greedy = hf_greedy(tiny_qwen3[1], prompt, 8)
    stop = greedy[3]
    first = greedy.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.token_ids == greedy[:first + 1] and out.finish_reason == "stop"
    config = llm.engine.config
    llm.engine.config = replace(config, eos_token_ids=config.eos_token_ids | {greedy[1]})
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        assert out.token_ids == greedy[:2] and out.finish_reason == "stop"
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
        assert out.token_ids == greedy and out.finish_reason == "length"
    finally:
        llm.engine.config = config
    long_prompt = random_prompts([60], seed=13)[0]  # max_model_len=64 cuts the completion at 4 tokens
    out = llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
