"""LoRA on the GPU (skipped without CUDA), in float32 so that greedy tokens are exact (bf16 rounds
the base and the deltas differently from transformers and flips random-weight near-ties): the
tiny Qwen3's three PEFT adapters give transformers + peft's tokens with CUDA graphs (each graph
variant: attention-only adapters replay graphs without the MLP's deltas) and eager, alone and
mixed, in graphs of 1, 8 and 32 sequences; Qwen3-0.6B's shapes with three rank-16 adapters
against transformers + peft (up to TF32 ties: same_greedy); TP=2 on two GPUs equals one GPU."""
import gc

import pytest
import torch

from nanovllm import LLM, LoRARequest, SamplingParams
from tests.conftest import random_prompts
from tests.peft_adapters import ALL, ADAPTERS, make_adapter, peft_greedy, tiny_adapters

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("peft")
ARGS = dict(dtype="float32", kvcache_block_size=16, max_model_len=128, max_num_batched_tokens=48, enable_lora=True,
            max_loras=3, max_lora_rank=16)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
NAMES = list(ADAPTERS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, model, adapters = tiny_adapters(tmp_path_factory)
    prompts = random_prompts([5, 17, 70, 1, 33, 9, 40], seed=3) * 4
    requests = {name: LoRARequest(name, i + 1, adapters[name][0]) for i, name in enumerate(NAMES)}
    models = {name: adapters[name][1] for name in NAMES} | {None: model}
    expected = {name: peft_greedy(m, prompts[:7], GREEDY.max_tokens) * 4 for name, m in models.items()}
    return path, prompts, requests, expected


def run(llm, prompts, loras):
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_tiny_matches_peft(tiny, enforce_eager):
    path, prompts, requests, expected = tiny
    llm = LLM(path, max_num_seqs=32, enforce_eager=enforce_eager, **ARGS)
    context, variants = llm.engine.model_runner.lora.context, []
    write = context.write_graph_inputs
    context.write_graph_inputs = lambda num_tokens: variants.append(write(num_tokens)) or variants[-1]
    kinds = {"qv": {"qkv_proj"}, "attn": {"qkv_proj", "o_proj"}, "all": set(context.all_kinds)}
    for name in NAMES:  # one sequence: graphs of batch size 1, the variant of the adapter's kinds
        variants.clear()
        assert run(llm, prompts[:1], requests[name]) == expected[name][:1]
        assert set(variants) == (set() if enforce_eager else {frozenset(kinds[name])})
        assert run(llm, prompts[:7], requests[name]) == expected[name][:7]
    names = [(NAMES + [None])[i % 4] for i in range(len(prompts))]  # 28 sequences: graphs of 32
    assert run(llm, prompts, [requests[n] if n else None for n in names]) == [expected[n][i] for i, n in
                                                                              enumerate(names)]


def test_speculative_decoding_with_adapters(tiny):
    """The base model as a draft model (drafting without adapters) beside the tiny Qwen3's
    adapters: verify steps replay graphs of q_len 4 with the adapters' deltas, and the tokens
    are still transformers + peft's."""
    path, prompts, requests, expected = tiny
    llm = LLM(path, max_num_seqs=32, **ARGS, speculative_config={"model": path, "num_speculative_tokens": 3})
    graph_runner, replayed = llm.engine.model_runner.graph_runner, []
    replay = graph_runner.replay
    graph_runner.replay = lambda key, *a, replay=replay: replayed.append(key) or replay(key, *a)
    names = [(NAMES + [None])[i % 4] for i in range(7)]
    assert run(llm, prompts[:7], [requests[n] if n else None for n in names]) == [expected[n][i] for i, n in
                                                                                 enumerate(names)]
    assert run(llm, prompts[:1], requests["all"]) == expected["all"][:1]
    assert sum(key[1] == 4 for key in replayed) >= 3 and llm.engine.spec_metrics.num_accepted_tokens > 0
    del graph_runner, replay, llm
    gc.collect()
    torch.cuda.empty_cache()


def test_one_sequence_in_bfloat16_joins_the_adapter_to_each_product(tiny, monkeypatch):
    """bf16, one sequence: each product's adapter rides in gemv.py's launch (GemvLoRA), eager and
    in CUDA graphs, with the tokens of the many-row path (norm or gate, base product, shrink,
    expand) run on that one row, for each adapter and for none. The two paths round the normed or
    gated input in different kernels (an element may land one bf16 unit apart), so they agree up to
    a first difference where the many-row path's two best logprobs were within BF16_TIE, and the
    emitted tokens' logprobs agree within BF16_TIE before it (which a delta gone wrong would not:
    each adapter moves them by far more)."""
    from nanovllm.kernels import gemv as gemv_module
    from nanovllm.layers.lora import LoRALinearMethod
    path, prompts, requests, _ = tiny
    args = ARGS | dict(dtype="bfloat16", max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, logprobs=2)

    def generate(**kwargs):
        llm = LLM(path, **args, **kwargs)
        outputs = {name: llm.generate(prompts[:1], params, use_tqdm=False,
                                      lora_request=requests.get(name))[0].outputs[0] for name in NAMES + [None]}
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return outputs

    with monkeypatch.context() as patch:
        patch.setattr(LoRALinearMethod, "_one_launch", lambda self, x: False)
        expected = {}
        for name, out in generate(enforce_eager=True).items():
            best = [sorted((lp.logprob for lp in position.values()), reverse=True) for position in out.logprobs]
            expected[name] = (out.token_ids, [b[0] - b[1] for b in best], emitted_logprobs(out))
    fused = []
    for name in ("gemv", "norm_gemv"):
        fn = getattr(gemv_module, name)
        monkeypatch.setattr(gemv_module, name, lambda *a, fn=fn, **k: fused.append(k.get("lora")) or fn(*a, **k))
    for enforce_eager in (True, False):
        fused.clear()
        for name, out in generate(enforce_eager=enforce_eager).items():
            tokens, gaps, logprobs = expected[name]
            assert same_greedy(out.token_ids, (tokens, gaps), BF16_TIE), (name, enforce_eager)
            agreed = next((i for i, (a, b) in enumerate(zip(out.token_ids, tokens)) if a != b), len(tokens))
            got = emitted_logprobs(out)[:agreed]
            assert all(abs(a - b) < BF16_TIE for a, b in zip(got, logprobs)), (name, enforce_eager, got, logprobs)
        assert sum(lora is not None for lora in fused) >= 4  # run eagerly or captured: every kind of product


def emitted_logprobs(out) -> list[float]:
    """The logprob of each token a completion emitted."""
    return [position[token].logprob for position, token in zip(out.logprobs, out.token_ids)]


@pytest.fixture(scope="module")
def qwen3_06b(tmp_path_factory):
    """Qwen3-0.6B's shapes with random float32 weights and three rank-16 PEFT adapters (all seven
    projections; q and v; alpha 32 with rsLoRA): (directory, prompts, LoRARequests, references as
    _greedy gives them)."""
    from transformers import AutoConfig, Qwen3ForCausalLM

    from nanovllm.loader.source import BUILTIN_CONFIGS
    config = AutoConfig.from_pretrained(str(BUILTIN_CONFIGS["qwen3-0.6b"]))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).eval()
    root = tmp_path_factory.mktemp("qwen3-0.6b-lora")
    model.save_pretrained(root / "base")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 150000, (n,), generator=g).tolist() for n in (5, 129, 300, 17)]
    configs = [dict(r=16, lora_alpha=16, target_modules=ALL),
               dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
               dict(r=8, lora_alpha=32, target_modules=ALL, use_rslora=True)]
    requests, expected = [], []
    for i, args in enumerate(configs):
        peft_model = make_adapter(model, root / f"a{i}", i, **args)
        expected.append([_greedy(peft_model, p) for p in prompts])
        requests.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
        del peft_model
    expected.append([_greedy(model, p) for p in prompts])
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return str(root / "base"), prompts, requests, expected


def _greedy(model, prompt):
    """transformers + peft's greedy tokens for prompt, and at each the gap between its two largest logits."""
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                             min_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        top2 = model(out[:, :-1]).logits[0, len(prompt) - 1:].float().topk(2, -1).values
    return out[0, len(prompt):].tolist(), (top2[:, 0] - top2[:, 1]).tolist()


# The float32 engine's tensor-core products (attention tiles, the few-row GEMM) round their inputs
# to TF32 (10 mantissa bits, a relative 2^-11), which moves logits near 3 by about 1e-3: where the
# reference's two best tokens are closer than this, either is a correct greedy choice.
TF32_TIE = 1e-2
# Inputs one bf16 unit apart (a relative 2^-8) move a logit of the tiny model (|logit| <= 10,
# measured) by up to about 2^-8 * 10, and the gap between two logits by twice that.
BF16_TIE = 2 * 2**-8 * 10


def same_greedy(got, want, tie=TF32_TIE) -> bool:
    """got equals want's tokens up to their first difference, where want's top two were a tie
    (closer than `tie`)."""
    tokens, gaps = want
    diff = next((i for i, (a, b) in enumerate(zip(got, tokens)) if a != b), None)
    return len(got) == len(tokens) and (diff is None or gaps[diff] < tie)


def test_qwen3_06b_shapes_match_peft(qwen3_06b):
    path, prompts, requests, expected = qwen3_06b
    llm = LLM(path, dtype="float32", max_model_len=1024, gpu_memory_utilization=0.5, enable_lora=True, max_loras=2,
              max_lora_rank=16)
    for lora, want in zip(requests + [None], expected):
        assert all(map(same_greedy, run(llm, prompts, lora), want))
    loras = [requests[i % 3] for i in range(len(prompts))]  # three adapters, two slots: one waits
    assert all(map(same_greedy, run(llm, prompts, loras), [expected[i % 3][i] for i in range(len(prompts))]))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_matches_one_gpu(tiny):
    """TP=2 with NCCL and CUDA graphs; max_num_seqs=4: prefill products of more rows than the
    symmetric buffers hold, which LoRA layers sum with NCCL rather than chunk by chunk."""
    path, prompts, requests, expected = tiny
    names = [(NAMES + [None])[i % 4] for i in range(7)]
    loras = [requests[n] if n else None for n in names]
    llm = LLM(path, tensor_parallel_size=2, max_num_seqs=4, **ARGS)
    assert run(llm, prompts[:7], loras) == [expected[n][i] for i, n in enumerate(names)]
    del llm
    gc.collect()
