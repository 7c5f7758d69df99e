"""A vLLM user's code, written from vLLM's documentation, run on nanovllm: the names it imports,
the types it gets back, the defaults it relies on, and clear errors for what nanovllm lacks."""
import dataclasses
import json
import pickle
import shutil

import pytest
import torch

from nanovllm import LLM, CompletionOutput, LLMEngine, Logprob, RequestOutput, SamplingParams, TokensPrompt
from nanovllm.sampling_params import RequestOutputKind
from tests.conftest import VOCAB, hf_greedy, random_prompts

ARGS = dict(device="cpu", kvcache_block_size=16, max_model_len=128)


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(tiny_qwen3[0], **ARGS)


# ---- outputs: vLLM's types, logprobs as plain lists -----------------------------------------

def test_logprobs_are_lists_of_dicts(llm):
    """vLLM's default: CompletionOutput.logprobs a list with one {token id: Logprob} per token, and
    RequestOutput.prompt_logprobs a list with None first; lists, so list operations, pickling and
    dataclasses.asdict + json work on them."""
    prompt = random_prompts([9], seed=40)[0]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=5, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    [out] = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    assert isinstance(out, RequestOutput) and isinstance(out.outputs[0], CompletionOutput)
    completion = out.outputs[0]
    assert type(completion.logprobs) is list and len(completion.logprobs) == 5
    for token, position in zip(completion.token_ids, completion.logprobs):
        assert type(position) is dict and token in position and 2 <= len(position) <= 3
        assert all(isinstance(lp, Logprob) and lp.logprob <= 0 and lp.rank >= 1 for lp in position.values())
    assert type(out.prompt_logprobs) is list and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 9
    assert all(prompt[i] in out.prompt_logprobs[i] for i in range(1, 9))
    assert completion.logprobs[1:3] + [] == [completion.logprobs[1], completion.logprobs[2]]
    assert pickle.loads(pickle.dumps(completion)) == completion
    as_json = json.loads(json.dumps(dataclasses.asdict(out)))
    first = completion.token_ids[0]
    assert as_json["outputs"][0]["logprobs"][0][str(first)]["logprob"] == completion.logprobs[0][first].logprob
    assert out.metrics is None  # as vLLM's LLM, which keeps no per-request stats by default


def test_flat_logprobs_hold_the_same_values(llm):
    """SamplingParams(flat_logprobs=True): vLLM's FlatLogprobs, a read-only sequence of the same dicts."""
    from nanovllm.outputs import FlatLogprobs
    prompt = random_prompts([9], seed=41)[0]
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    plain, flat = (llm.generate([prompt], p, use_tqdm=False)[0]
                   for p in (params, dataclasses.replace(params, flat_logprobs=True)))
    assert isinstance(flat.outputs[0].logprobs, FlatLogprobs) and isinstance(flat.prompt_logprobs, FlatLogprobs)
    assert flat.outputs[0].token_ids == plain.outputs[0].token_ids
    assert list(flat.outputs[0].logprobs) == plain.outputs[0].logprobs
    assert list(flat.prompt_logprobs) == plain.prompt_logprobs
    assert flat.outputs[0].logprobs[-2:] == plain.outputs[0].logprobs[-2:]
    with pytest.raises(ValueError, match="flat_logprobs must be True or False"):
        SamplingParams(flat_logprobs="yes")


def test_add_request_takes_vllms_arguments_in_order(tiny_qwen3):
    """LLMEngine.add_request(request_id, prompt, params, arrival_time, lora_request, priority), as
    vLLM's: a time.time() fourth runs; an adapter passed fourth, or a priority other than 0, is a
    ValueError that queues nothing, and the engine keeps serving."""
    import time
    from nanovllm import LoRARequest
    engine = LLMEngine.from_engine_args(tiny_qwen3[0], **ARGS)
    prompt = random_prompts([6], seed=45)[0]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", prompt, params, time.time())
    engine.add_request("b", prompt, params, None, None, 0)
    with pytest.raises(ValueError, match="arrival_time must be a time in seconds"):
        engine.add_request("c", prompt, params, LoRARequest("x", 1, "/nowhere"))
    with pytest.raises(ValueError, match="no priority scheduling"):
        engine.add_request("d", prompt, params, priority=1)
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {out.request_id: out.outputs[0].token_ids for out in engine.step() if out.finished}
    assert sorted(finished) == ["a", "b"] and finished["a"] == finished["b"] == hf_greedy(tiny_qwen3[1], prompt, 3)


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_streamed_logprobs_add_up_to_the_final_ones(tiny_qwen3, kind):
    """LLMEngine.step's outputs: each CUMULATIVE report a prefix of the final list (the same dict
    objects, made once), the DELTA reports its pieces, in order."""
    engine = LLMEngine.from_engine_args(tiny_qwen3[0], **ARGS)
    prompt = random_prompts([7], seed=42)[0]
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True,
                                                   output_kind=kind))
    reports = []
    while engine.has_unfinished_requests():
        reports += [out.outputs[0] for out in engine.step()]
    assert reports[-1].finished()
    if kind == RequestOutputKind.CUMULATIVE:
        final = reports[-1].logprobs
        assert len(final) == 6 and all(type(r.logprobs) is list for r in reports)
        assert all(all(a is b for a, b in zip(r.logprobs, final)) for r in reports)
    else:
        final = [position for r in reports for position in r.logprobs]
        assert len(final) == 6 and [t for r in reports for t in r.token_ids] == hf_greedy(tiny_qwen3[1], prompt, 6)
    assert all(next(iter(position.values())).rank == 1 for position in final)  # greedy: the top token


# ---- defaults ---------------------------------------------------------------------------------

def test_generation_config_max_new_tokens_is_the_default_max_tokens(tiny_qwen3, tmp_path):
    """vLLM maps generation_config.json's max_new_tokens to max_tokens: generate(prompts) with no
    SamplingParams makes that many tokens, not SamplingParams' 16."""
    path = tmp_path / "m"
    shutil.copytree(tiny_qwen3[0], path)
    (path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 21, "temperature": 0.5}))
    llm = LLM(str(path), **ARGS)
    defaults = llm.get_default_sampling_params()
    assert (defaults.max_tokens, defaults.temperature) == (21, 0.5)
    assert not llm.config.eos_token_ids  # the tiny model has no EOS: every completion runs to max_tokens
    [out] = llm.generate([random_prompts([5], seed=43)[0]], use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 21 and out.outputs[0].finish_reason == "length"
    assert LLM(str(path), generation_config="vllm", **ARGS).get_default_sampling_params().max_tokens == 16


# ---- engine arguments -------------------------------------------------------------------------

def test_engine_args_build_an_engine(tiny_qwen3):
    """vLLM's LLMEngine.from_engine_args(EngineArgs(model=..., **args)); EngineArgs' fields are the
    arguments LLM(...) takes and the Config holds, resolved."""
    from nanovllm import EngineArgs
    from nanovllm.engine_args import EngineArgs as Declared
    assert EngineArgs is Declared
    path, hf = tiny_qwen3
    args = EngineArgs(model=path, max_num_seqs=4, **ARGS)
    engine = LLMEngine.from_engine_args(args)
    config = engine.config
    assert isinstance(config, EngineArgs) and config.max_num_seqs == 4 and config.max_model_len == 128
    assert config.device == torch.device("cpu") and config.dtype == torch.float32 and config.hf_config is not None
    assert args.device == "cpu" and args.dtype == "auto"  # the user's arguments are left as given
    prompt = random_prompts([6], seed=44)[0]
    engine.add_request("0", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].outputs[0].token_ids == hf_greedy(hf, prompt, 4)
    llm = LLM(**dataclasses.asdict(args))
    assert {f.name: getattr(llm.config, f.name) for f in dataclasses.fields(EngineArgs)} == \
        {f.name: getattr(config, f.name) for f in dataclasses.fields(EngineArgs)}


def test_engine_args_are_checked_by_name(tiny_qwen3):
    from nanovllm import EngineArgs
    with pytest.raises(TypeError, match="no engine argument 'max_num_seq'; did you mean 'max_num_seqs'"):
        LLM(tiny_qwen3[0], max_num_seq=4, **ARGS)
    with pytest.raises(TypeError, match="hf_config"):  # resolved by the engine, not an argument
        EngineArgs(model=tiny_qwen3[0], hf_config=None)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        LLMEngine.from_engine_args(EngineArgs(model=tiny_qwen3[0], max_num_seqs=0, **ARGS))
    with pytest.raises(TypeError, match="no engine argument 'swap_space': a preempted sequence is recomputed"):
        LLM(tiny_qwen3[0], swap_space=4, **ARGS)
    with pytest.raises(TypeError, match="no engine argument 'enable_chunked_prefill': prefill is always chunked"):
        LLMEngine.from_engine_args(tiny_qwen3[0], enable_chunked_prefill=True)
    with pytest.raises(ValueError, match="block_size=16 and kvcache_block_size=32 are two names for one argument"):
        EngineArgs(model=tiny_qwen3[0], block_size=16, kvcache_block_size=32)
    with pytest.raises(TypeError, match="no engine argument 'task': nanovllm runs generative models only"):
        LLM(tiny_qwen3[0], task="embed", **ARGS)
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        LLM(tiny_qwen3[0], enforce_eager="yes", **ARGS)


def test_vllm_defaults_none_and_skip_tokenizer_init(tiny_qwen3, tmp_path):
    """enable_prefix_caching=None (vLLM's default) is on; skip_tokenizer_init loads none: token
    prompts run, text prompts are refused naming the tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    assert LLM(tiny_qwen3[0], enable_prefix_caching=None, **ARGS).config.enable_prefix_caching is True
    path = tmp_path / "m"
    shutil.copytree(tiny_qwen3[0], path)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="w1").save_pretrained(path)
    assert LLM(str(path), **ARGS).get_tokenizer() is not None
    llm = LLM(str(path), skip_tokenizer_init=True, **ARGS)
    assert llm.get_tokenizer() is None
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text"], use_tqdm=False)


def test_generate_takes_vllm_positional_arguments_and_priority(llm):
    """generate(prompts, params, use_tqdm, lora_request, priority) positionally, as vLLM's; priority
    only as zeros (first come, first served); the engine's tokenizer as vLLM's LLMEngine gives it."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate([[1, 2, 3]], params, False, None, [0])
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match=r"got priority \[1\], but requests are scheduled first come, first served"):
        llm.generate([[1, 2, 3]], params, False, None, [1])
    assert llm.llm_engine.get_tokenizer() is llm.llm_engine.tokenizer is llm.get_tokenizer()


def test_tokenizer_argument_replaces_the_models(tiny_qwen3, tmp_path):
    """vLLM's tokenizer engine argument (a folder here; a hub id works the same): text prompts are
    encoded and completions decoded with it, though the model has no tokenizer of its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = [f"w{i}" for i in range(VOCAB - 1)]
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    assert LLM(tiny_qwen3[0], **ARGS).get_tokenizer() is None
    llm = LLM(tiny_qwen3[0], tokenizer=str(tmp_path), **ARGS)
    out = llm.generate("w3 w14 w15 w9", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == [4, 15, 16, 10]
    assert out.outputs[0].token_ids == hf_greedy(tiny_qwen3[1], [4, 15, 16, 10], 5)
    assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids)
    with pytest.raises(ValueError, match="tokenizer='/nowhere' is not a tokenizer folder or hub id"):
        LLM(tiny_qwen3[0], tokenizer="/nowhere", **ARGS)


def test_vllm_names_block_size_and_seed_none(tiny_qwen3):
    """block_size, vLLM's name for kvcache_block_size; seed=None, a random engine seed: unseeded
    samples differ between two engines, where the default seed 0 repeats them."""
    args = {k: v for k, v in ARGS.items() if k != "kvcache_block_size"}
    prompt, params = random_prompts([6], seed=45)[0], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    runs = {}
    for seed in (None, 0):
        llms = [LLM(tiny_qwen3[0], block_size=32, seed=seed, **args) for _ in range(2)]
        assert all(llm.config.kvcache_block_size == 32 and isinstance(llm.config.seed, int) for llm in llms)
        runs[seed] = [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids for llm in llms]
    assert runs[0][0] == runs[0][1] and runs[None][0] != runs[None][1]


def test_gpu_memory_utilization_on_the_cpu_warns_once(tiny_qwen3, caplog):
    """On a CPU the KV pool is cpu_kvcache_space_gib (or num_kvcache_blocks): a
    gpu_memory_utilization given there is named in one warning, with the argument that applies."""
    with caplog.at_level("WARNING", logger="nanovllm"):
        LLM(tiny_qwen3[0], **ARGS)
        assert not caplog.records
        LLM(tiny_qwen3[0], gpu_memory_utilization=0.5, cpu_kvcache_space_gib=0.25, **ARGS)
        LLM(tiny_qwen3[0], gpu_memory_utilization=0.5, num_kvcache_blocks=40, **ARGS)
    messages = [r.getMessage() for r in caplog.records if "gpu_memory_utilization" in r.getMessage()]
    assert len(messages) == 2 and "cpu_kvcache_space_gib=0.25" in messages[0] and "num_kvcache_blocks" in messages[1]


# ---- top_k at or above the vocabulary -----------------------------------------------------------

def top_k_tensors(top_ks, temperature=1.0):
    from nanovllm.sampling.inputs import sampling_tensors
    from nanovllm.sequence import Sequence
    seqs = [Sequence([1, 2, 3], SamplingParams(temperature=temperature, top_k=k)) for k in top_ks]
    return sampling_tensors(seqs, torch.device("cpu"), [], {}, None, VOCAB)


def test_top_k_of_the_whole_vocabulary_is_no_top_k():
    """The step's tensors, which every sampling path reads (the CPU sort, the Triton kernels on
    CUDA, the tensor-parallel shards' draw): a top_k at or above the vocabulary is no top-k, so no
    path asks torch.topk or a kernel for more entries than a row has."""
    st = top_k_tensors([VOCAB + 1000, VOCAB])
    assert st.top_k is None and st.max_top_k == 0 and st.only_temperature  # the Gumbel-max kernel, or the shards
    st = top_k_tensors([VOCAB + 1000, 5])
    assert st.top_k.tolist() == [0, 5] and st.max_top_k == 0  # the sorted path (not every row has a top k)
    st = top_k_tensors([VOCAB - 1, 5])
    assert st.top_k.tolist() == [VOCAB - 1, 5] and st.max_top_k == VOCAB - 1  # the top-k path, over VOCAB - 1


@pytest.mark.parametrize("tp", [1, 2])
def test_top_k_above_the_vocabulary_samples_the_whole_vocabulary(tiny_qwen3, tp):
    """vLLM treats top_k >= vocabulary size as no top-k: a seeded request draws the very tokens it
    draws with top_k=0, alone or beside a request with a real top_k, on one rank and over two
    tensor-parallel ranks (the shards' own draw)."""
    llm = LLM(tiny_qwen3[0], tensor_parallel_size=tp, **ARGS)
    prompts = random_prompts([8, 5], seed=45)
    base = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, [SamplingParams(top_k=0, seed=i, **base)
                                                                     for i in range(2)], use_tqdm=False)]
    for top_ks in ([VOCAB + 1000, VOCAB], [VOCAB + 1000, 5]):
        outs = llm.generate(prompts, [SamplingParams(top_k=k, seed=i, **base) for i, k in enumerate(top_ks)],
                            use_tqdm=False)
        assert outs[0].outputs[0].token_ids == plain[0]
        assert outs[1].outputs[0].token_ids == plain[1] or top_ks[1] == 5


def test_logprobs_beyond_the_vocabulary_are_refused(tiny_qwen3):
    llm = LLM(tiny_qwen3[0], max_logprobs=-1, **ARGS)
    with pytest.raises(ValueError, match=f"logprobs={VOCAB + 1} is more than the vocabulary's {VOCAB} tokens"):
        llm.generate([[1, 2]], SamplingParams(logprobs=VOCAB + 1), use_tqdm=False)
    assert len(llm.generate([[1, 2]], SamplingParams(max_tokens=2, logprobs=VOCAB), use_tqdm=False)[0]
               .outputs[0].logprobs[0]) == VOCAB


def test_logprobs_minus_one_is_the_whole_vocabulary(tiny_qwen3):
    """vLLM's logprobs=-1 and prompt_logprobs=-1: every token's, within max_logprobs."""
    llm = LLM(tiny_qwen3[0], max_logprobs=-1, **ARGS)
    whole = SamplingParams(max_tokens=2, logprobs=-1, prompt_logprobs=-1, temperature=0)
    out = llm.generate([[1, 2, 3]], whole, use_tqdm=False)[0]
    same = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=VOCAB, prompt_logprobs=VOCAB, temperature=0),
                        use_tqdm=False)[0]
    assert whole.logprobs == -1 and len(out.outputs[0].logprobs[0]) == VOCAB == len(out.prompt_logprobs[1])
    assert out.outputs[0].logprobs == same.outputs[0].logprobs and out.prompt_logprobs == same.prompt_logprobs
    limited = LLM(tiny_qwen3[0], **ARGS)
    with pytest.raises(ValueError, match=f"logprobs=-1 \\(the whole vocabulary, {VOCAB}\\) is more than max_logprobs=20"):
        limited.generate([[1, 2]], SamplingParams(logprobs=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs must be None, -1"):
        SamplingParams(logprobs=-2)


# ---- what vLLM has and nanovllm does not ------------------------------------------------------

@pytest.mark.parametrize("kwargs,names", [
    (dict(best_of=2), ["best_of=2 is not supported", "n=2", "cumulative_logprob"]),
    (dict(n=2, best_of=4), ["best_of=4 is not supported"]),
    (dict(use_beam_search=True), ["beam search", "use_beam_search", "not supported"]),
])
def test_unsupported_sampling_features_say_so(kwargs, names):
    with pytest.raises(NotImplementedError) as error:
        SamplingParams(**kwargs)
    assert all(name in str(error.value) for name in names), str(error.value)
    assert SamplingParams(n=3, best_of=3).n == 3  # best_of equal to n is what n does
    with pytest.raises(ValueError, match="best_of must be at least n, got n=2 and best_of=1"):
        SamplingParams(n=2, best_of=1)


@pytest.mark.parametrize("kwargs", [dict(guided_decoding={"json": {"type": "object"}}),
                                    dict(structured_outputs={"regex": "[a-z]+"})])
def test_structured_outputs_take_their_params_class(kwargs):
    """vLLM's structured_outputs (and its older name guided_decoding) take a StructuredOutputsParams,
    which the error names (tests/test_structured_outputs.py runs them)."""
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(**kwargs)


def test_unsupported_llm_features_say_so(llm):
    from nanovllm.outputs import RequestOutput as Output
    with pytest.raises(NotImplementedError, match=r"beam search \(LLM.beam_search\) is not supported.*n="):
        llm.beam_search([{"prompt": "a"}], None)
    for method in ("embed", "encode", "classify", "score", "reward"):
        with pytest.raises(NotImplementedError, match=f"LLM.{method} runs a pooling model.*not support"):
            getattr(llm, method)(["a"])
    for pair in [("sleep", "wake_up"), ("collective_rpc", "apply_model"), ("start_profile", "stop_profile")]:
        for method in pair:
            with pytest.raises(NotImplementedError, match=f"LLM.{pair[0]} and {pair[1]} are not supported"):
                getattr(llm, method)()
    with pytest.raises(AttributeError):  # a real typo still is one
        llm.generat([[1, 2]])
    with pytest.raises(TypeError, match="top_kk"):
        SamplingParams(top_kk=3)
    assert Output.metrics is None  # a field, None as vLLM's LLM reports it


def test_prompt_token_ids_keyword(llm, tiny_qwen3):
    """vLLM's former generate(prompt_token_ids=...): one token-id list or a list of them."""
    prompts = random_prompts([5, 8], seed=46)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    expected = [hf_greedy(tiny_qwen3[1], p, 3) for p in prompts]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected and outs[0].prompt_token_ids == prompts[0]
    [one] = llm.generate(prompt_token_ids=prompts[1], sampling_params=params, use_tqdm=False)
    assert one.outputs[0].token_ids == expected[1]
    with pytest.raises(ValueError, match="pass the prompts once"):
        llm.generate(prompts, params, prompt_token_ids=prompts)


# ---- start-up compiles every sampling kernel -------------------------------------------------

def test_sampler_warm_up_batches_cover_every_path():
    """The start-up batches (run on CUDA, whose paths are Triton kernels) run, here on the CPU, and
    between them take every branch of Sampler.forward's dispatch: the Gumbel-max, nucleus and
    top-k kernels on the raw logits and after penalties, with and without the prompt's tokens,
    and logprobs of greedy rows (raw) and of processed logits."""
    from nanovllm.sampling.inputs import sampling_tensors
    from nanovllm.sampling.processors import PROCESSORS, Penalties
    from nanovllm.sampling.warmup import WARMUP_BATCHES, warm_up_sampler
    from nanovllm.sequence import Sequence
    for mode in ("raw_logprobs", "processed_logprobs"):
        warm_up_sampler(mode, VOCAB, torch.float32, torch.device("cpu"))
    kinds = set()
    for fields in WARMUP_BATCHES:
        seqs = [Sequence([0, 1], SamplingParams(**fields)) for _ in range(2)]
        processors = [cls(VOCAB, frozenset(), torch.device("cpu")) for cls in PROCESSORS]
        st = sampling_tensors(seqs, torch.device("cpu"), processors, {}, None, VOCAB)
        penalties = next((state for processor, state in st.processors if isinstance(processor, Penalties)), None)
        draw = ("greedy" if st.temperatures is None else "top_k" if st.max_top_k else "nucleus"
                if st.top_p is not None or st.min_p is not None else "gumbel" if st.top_k is None else "sorted")
        processed = "penalised" if penalties is not None else "raw"
        kinds |= {(draw, processed), ("prompt_mask", penalties is not None and penalties.prompt_mask is not None),
                  ("logprobs", st.num_logprobs >= 0,
                                                                                      draw, processed)}
    assert {(d, p) for d in ("gumbel", "nucleus", "top_k") for p in ("raw", "penalised")} <= kinds
    assert {("prompt_mask", True), ("prompt_mask", False), ("logprobs", True, "greedy", "raw"),
            ("logprobs", True, "gumbel", "penalised")} <= kinds


def sampling_kernel_variants() -> dict:
    """The compiled variants of every sampling kernel in this process, on the current GPU."""
    from nanovllm.kernels import logits_stats, penalty, sampling
    kernels = [getattr(m, name) for m in (sampling, logits_stats, penalty) for name in dir(m)
               if name.endswith("_kernel") and hasattr(getattr(m, name), "device_caches")]
    device = torch.cuda.current_device()
    return {k.fn.__name__: len(k.device_caches[device][0]) for k in kernels}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_no_sampling_kernel_compiles_inside_generate(tiny_qwen3, mode):
    """After LLM(...) no generate compiles a sampling kernel: greedy, temperature, top-k (several k),
    top-p, min-p, penalties, logprobs (0 too) and prompt logprobs, alone and mixed; top_k beyond
    the vocabulary draws what top_k=0 draws."""
    pytest.importorskip("triton")
    llm = LLM(tiny_qwen3[0], device="cuda", max_model_len=128, logprobs_mode=mode)
    before = sampling_kernel_variants()
    assert sum(before.values()) >= 7
    prompts = random_prompts([9, 17, 30], seed=47)
    base = dict(max_tokens=5, ignore_eos=True)
    batches = [dict(temperature=0), dict(temperature=0.7), dict(top_k=5), dict(top_k=40, top_p=0.9),
               dict(top_p=0.8), dict(min_p=0.1), dict(presence_penalty=0.5), dict(repetition_penalty=1.2, top_k=20),
               dict(frequency_penalty=0.3, top_p=0.9), dict(logprobs=0), dict(logprobs=5, top_k=3),
               dict(temperature=0, logprobs=20, prompt_logprobs=2), dict(repetition_penalty=1.1, logprobs=2)]
    for fields in batches:
        llm.generate(prompts, SamplingParams(**base, **fields), use_tqdm=False)
    llm.generate(prompts, [SamplingParams(**base, **fields) for fields in batches[:3]], use_tqdm=False)
    assert sampling_kernel_variants() == before
    seeded = [llm.generate(prompts, SamplingParams(**base, top_k=k, seed=1), use_tqdm=False) for k in (0, VOCAB + 1000)]
    assert [o.outputs[0].token_ids for o in seeded[0]] == [o.outputs[0].token_ids for o in seeded[1]]


# ---- bench.py without a GPU ---------------------------------------------------------------------

def test_bench_says_it_needs_cuda_up_front():
    """--help says bench.py needs a CUDA GPU; without one it exits with that message before
    importing nanovllm or transformers (seconds, not the engine's imports)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    help_text = subprocess.run([sys.executable, "bench.py", "--help"], cwd=root, capture_output=True, text=True,
                               check=True).stdout
    assert "Needs a CUDA GPU" in help_text.split("options:")[0]
    run = subprocess.run([sys.executable, "-X", "importtime", "bench.py", "--logprobs", "5", "--flat-logprobs"],
                         cwd=root, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 1 and "needs a CUDA device" in run.stderr
    imported = {line.split("|")[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" in imported and not {"nanovllm", "transformers"} & imported
