"""Mixture-of-experts models on CPU against transformers: tiny random Qwen3-MoE (norm_topk_prob on
and off, a decoder_sparse_step of 2, a dense layer from mlp_only_layers) and Mixtral written by
transformers: greedy tokens for mixed batches, chunked prefill, prefix hits, forced preemption,
tensor parallelism (gloo) and the Triton kernels in the interpreter; the routing and the sparse
block against transformers' modules; checkpoints with stacked experts, float8 experts, errors."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import MixtralForCausalLM as HFMixtral

from nanovllm import LLM, SamplingParams
from nanovllm.layers import moe_method
from tests.conftest import TINY_MOE, make_tiny_model, needs_interpreter, random_prompts
from tests.test_engine_vs_transformers import LENGTHS, check_against_hf

@pytest.fixture(scope="module", params=list(TINY_MOE))
def tiny_moe(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory)


def test_checkpoint_per_expert_names_and_layer_kinds(tiny_moe):
    """transformers writes one tensor per expert and projection; the sparse layers are its."""
    from safetensors import safe_open

    from nanovllm.models.moe import SparseMoeBlock
    path, hf_model = tiny_moe
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    block = "block_sparse_moe" if isinstance(hf_model, HFMixtral) else "mlp"
    assert f"model.layers.{hf_model.config.num_hidden_layers - 1}.{block}.experts.0.down_proj.weight".replace(
        "down_proj", "w2" if block == "block_sparse_moe" else "down_proj") in names
    llm = LLM(path, device="cpu")
    ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in llm.engine.model_runner.model.model.layers]
    assert ours == [hasattr(layer.mlp, "experts") for layer in hf_model.model.layers]
    assert ours != [True] * len(ours) or isinstance(hf_model, HFMixtral)


def test_batch_of_mixed_lengths(tiny_moe):
    path, hf_model = tiny_moe
    llm = LLM(path, kvcache_block_size=16, device="cpu")
    outs = check_against_hf(llm, hf_model, random_prompts(LENGTHS))
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_preemption(tiny_moe):
    path, hf_model = tiny_moe
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=112, device="cpu")
    check_against_hf(llm, hf_model, random_prompts([50, 45, 60, 30], seed=4), max_tokens=40)
    assert llm.engine.scheduler.num_preemptions > 0


@needs_interpreter
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_triton_kernels_in_the_interpreter(arch, tmp_path_factory, monkeypatch):
    """The routing kernel and both fused-MoE paths (prefill chunks: sorted; decode steps of up to
    PAIRS_MAX_TOKENS sequences: pairs) through the whole engine, in Triton's interpreter."""
    from nanovllm.kernels import fused_moe
    monkeypatch.setattr(moe_method, "uses_kernels", lambda x: True)
    paths, run = [], fused_moe.fused_moe

    def recording(x, router_logits, w13, w2, top_k, *args):
        paths.append(fused_moe.default_config(x.size(0), top_k, router_logits.size(1)).pairs)
        return run(x, router_logits, w13, w2, top_k, *args)
    monkeypatch.setattr(fused_moe, "fused_moe", recording)
    path, hf_model = make_tiny_model(arch, tmp_path_factory)
    llm = LLM(path, kvcache_block_size=16, max_num_batched_tokens=24, device="cpu")
    shared = random_prompts([33], seed=5)[0]
    check_against_hf(llm, hf_model, [shared + [1], *random_prompts([5, 9], seed=6)], max_tokens=6)
    assert check_against_hf(llm, hf_model, [shared + [2, 3]], max_tokens=4)[0].num_cached_tokens == 32
    assert set(paths) == {True, False}


def _hf_block_and_ours(arch, tmp_path_factory, norm_topk_prob=None):
    """A sparse block of the tiny model (a copy: norm_topk_prob set as asked) and ours with its weights."""
    import copy

    from nanovllm.distributed.state import TensorParallel
    from nanovllm.models.moe import SparseMoeBlock
    _, hf_model = make_tiny_model(arch, tmp_path_factory)
    hf_block = copy.deepcopy(next(layer.mlp for layer in hf_model.model.layers if hasattr(layer.mlp, "gate")))
    config = hf_model.config
    if norm_topk_prob is not None:
        hf_block.gate.norm_topk_prob = norm_topk_prob
    inter = config.moe_intermediate_size if arch == "qwen3_moe" else config.intermediate_size
    ours = SparseMoeBlock(config, inter, norm_topk_prob is not False, TensorParallel())
    ours.gate.weight.data.copy_(hf_block.gate.weight)
    # transformers 5 stacks the experts as FusedMoE does: gate_up_proj [E, 2I, H], down_proj [E, H, I]
    ours.experts.w13_weight.data.copy_(hf_block.experts.gate_up_proj)
    ours.experts.w2_weight.data.copy_(hf_block.experts.down_proj)
    return hf_block, ours


@pytest.mark.parametrize("arch,norm_topk_prob,kernels", [
    ("qwen3_moe", True, False), ("qwen3_moe", False, False), ("mixtral", None, False),
    pytest.param("qwen3_moe", False, True, marks=needs_interpreter),
    pytest.param("mixtral", None, True, marks=needs_interpreter)])
def test_routing_and_block_match_transformers(arch, norm_topk_prob, kernels, tmp_path_factory, monkeypatch):
    """select_experts (the torch path) or moe_topk (kernels) chooses transformers' router's experts
    with its weights (float32), and the experts' weighted sum from the router's logits equals
    transformers' sparse block's output, on the torch path and (kernels) the Triton kernels in the
    interpreter: the sorted path, and the pair path, whose first kernel chooses the experts itself."""
    from nanovllm.kernels.moe_routing import moe_topk
    from nanovllm.layers.moe_method import select_experts
    if kernels:
        monkeypatch.setattr(moe_method, "uses_kernels", lambda x: True)
    hf_block, ours = _hf_block_and_ours(arch, tmp_path_factory, norm_topk_prob)
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_block.gate(x)
        logits = ours.gate(x)
        weights, ids = (moe_topk if kernels else select_experts)(logits, ours.experts.top_k, ours.experts.renormalize)
        assert torch.equal(ids.long(), hf_ids)
        torch.testing.assert_close(weights, hf_weights.float(), rtol=1e-6, atol=1e-7)
        want = hf_block(x[None])[0]
        torch.testing.assert_close(ours.experts(x, logits), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.experts(x[:3], logits[:3]), want[:3], rtol=1e-5, atol=1e-5)


def _save(path, tensors, config):
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def test_stacked_experts_checkpoint(tmp_path_factory, tmp_path):
    """A checkpoint in transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I] per layer) loads as the per-expert one does."""
    path, hf_model = make_tiny_model("qwen3_moe", tmp_path_factory)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    with open(os.path.join(path, "config.json")) as f:
        _save(tmp_path / "stacked", state, json.load(f))
    llm = LLM(str(tmp_path / "stacked"), kvcache_block_size=16, device="cpu")
    check_against_hf(llm, hf_model, random_prompts([5, 30], seed=8), max_tokens=8)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_dummy_weights_fill_every_expert(arch, tmp_path_factory):
    """load_format="dummy" writes a random checkpoint under the model's own expert names (one
    tensor per expert and projection, as transformers saves them), which fills every expert."""
    from nanovllm.loader.weights import dummy_weights
    from nanovllm.models.registry import model_class
    path, hf_model = make_tiny_model(arch, tmp_path_factory)
    llm = LLM(path, load_format="dummy", device="cpu", seed=3)
    cls = model_class(hf_model.config)
    names = dict(dummy_weights(cls, hf_model.config, 3, torch.device("cpu"), torch.float32))
    gate_up = [f for f, (_, shard) in cls.expert_mapping.items() if shard is not None]  # in shard order
    down = next(f for f, (_, shard) in cls.expert_mapping.items() if shard is None)
    i = len(hf_model.model.layers) - 1  # a sparse layer in each tiny model
    experts = llm.engine.model_runner.model.model.layers[i].mlp.experts
    for e in (0, experts.num_experts - 1):
        want = torch.cat([names[f"model.layers.{i}.mlp.experts.{e}.{f}.weight"] for f in gate_up])
        assert torch.equal(experts.w13_weight[e], want)
        assert torch.equal(experts.w2_weight[e], names[f"model.layers.{i}.mlp.experts.{e}.{down}.weight"])
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 3


def test_checkpoint_errors_name_the_expert(tmp_path_factory, tmp_path):
    from tests.test_reliability import copy_model, edit_tensors
    path, _ = make_tiny_model("mixtral", tmp_path_factory)
    m = copy_model(path, tmp_path / "missing")
    edit_tensors(m, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model.layers.1.mlp.experts.w13_weight \(expert 3's w3\)"):
        LLM(str(m), device="cpu")
    m = copy_model(path, tmp_path / "shape")
    edit_tensors(m, lambda t: t.update({"model.layers.0.block_sparse_moe.experts.2.w2.weight": torch.zeros(64, 31)}))
    with pytest.raises(ValueError, match=r"experts.2.w2.weight'.*shape \(64, 31\), expected \(64, 32\)"):
        LLM(str(m), device="cpu")


def test_config_checks(tmp_path_factory, tmp_path):
    """A tensor_parallel_size that does not split the experts' intermediate size (or, with
    expert parallelism, their count), and Mixtral's sliding window, are refused before anything
    is built."""
    from tests.test_reliability import copy_model
    for arch, edit, error in [
            ("qwen3_moe_step2", {"moe_intermediate_size": 42},  # 4 heads, 2 KV heads, 96 split over 4; 42 does not
             r"tensor_parallel_size=4 does not split this model: .*moe_intermediate_size=42 and intermediate_size=96"),
            ("mixtral", {"sliding_window": 4096}, "Mixtral with sliding_window=4096 is not supported")]:
        path = copy_model(make_tiny_model(arch, tmp_path_factory)[0], tmp_path / arch)
        with open(path / "config.json") as f:
            config = json.load(f)
        with open(path / "config.json", "w") as f:
            json.dump({**config, **edit}, f)
        with pytest.raises(ValueError, match=error):
            LLM(str(path), device="cpu", tensor_parallel_size=4 if "qwen" in arch else 1)
    path = make_tiny_model("mixtral", tmp_path_factory)[0]  # 4 heads, 6 experts
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not split this model: .*num_experts=6"):
        LLM(path, device="cpu", tensor_parallel_size=4, enable_expert_parallel=True)


def test_fp8_experts_match_a_fake_quantized_transformers(tmp_path_factory):
    """quantization="fp8" on the fly: every expert's weights per output row in float8 with the
    activations in the model dtype; the dense projections as test_fp8_weights checks them
    (weights per row, inputs per token). Prompt logprobs equal those of transformers' float32
    model given the same quantized values (to float32 error; the tolerance also allows a rounding
    of a quantized activation that flips between the two from float32 differences upstream), and
    greedy tokens are its argmax."""
    import copy

    from nanovllm.kernels.fp8 import quantize_fp8
    from tests.test_fp8_weights import PROJS, _prompt_logprobs, _reference_logprobs
    path, hf_model = make_tiny_model("qwen3_moe", tmp_path_factory)
    llm = LLM(path, device="cpu", quantization="fp8")
    experts = llm.engine.model_runner.model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and experts.w2_weight_scale.shape == (8, 64)
    reference = copy.deepcopy(hf_model)
    state = reference.state_dict()
    for name, w in state.items():
        if name.rsplit(".", 2)[-2] in PROJS or name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            q, s = quantize_fp8(w)
            state[name] = q.float() * s[..., None]
    reference.load_state_dict(state)

    def quantize_input(module, args):
        q, s = quantize_fp8(args[0])
        return (q.float() * s[..., None],)
    for name, module in reference.named_modules():
        if name.rsplit(".", 1)[-1] in PROJS:
            module.register_forward_pre_hook(quantize_input)
    prompt = random_prompts([37], seed=3)[0]
    got, want = _prompt_logprobs(llm, prompt), _reference_logprobs(reference, prompt)
    assert torch.allclose(got, want, atol=1e-3), (got - want).abs().max()
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].token_ids
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + greedy])).logits[0, len(prompt) - 1:-1]
    assert (logits.amax(-1) - logits.gather(1, torch.tensor(greedy)[:, None])[:, 0]).max() < 1e-4


def test_fp8_checkpoint_experts(tmp_path_factory, tmp_path):
    """A checkpoint in Qwen's FP8 format (Qwen3-30B-A3B-FP8: every projection's weight, the
    experts' too, as float8 blocks with weight_scale_inv; 16 x 16 here) selects quantization="fp8";
    each expert's weights are the checkpoint's dequantized ones, quantized per output row."""
    from safetensors.torch import load_file

    from nanovllm.kernels.fp8 import dequantize_blocks, quantize_fp8
    from tests.test_fp8_weights import BLOCK, PROJS, _block_quantize
    path, _ = make_tiny_model("qwen3_moe", tmp_path_factory)
    tensors, dequantized = {}, {}
    for name, tensor in load_file(os.path.join(path, "model.safetensors")).items():
        if name.rsplit(".", 2)[-2] in PROJS:
            q, scale = _block_quantize(tensor)
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
            dequantized[name] = dequantize_blocks(q, scale, (BLOCK, BLOCK))
        else:
            tensors[name] = tensor
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    _save(tmp_path, tensors, config)
    llm = LLM(str(tmp_path), device="cpu")
    assert llm.config.quantization == "fp8"
    for i in (0, 2):
        experts = llm.engine.model_runner.model.model.layers[i].mlp.experts
        for param, projs in (("w13_weight", ("gate_proj", "up_proj")), ("w2_weight", ("down_proj",))):
            want = torch.stack([torch.cat([dequantized[f"model.layers.{i}.mlp.experts.{e}.{p}.weight"] for p in projs])
                                for e in range(8)])
            q, s = quantize_fp8(want)
            assert torch.equal(getattr(experts, param).float() * getattr(experts, f"{param}_scale")[..., None],
                               q.float() * s[..., None])
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 4


def test_tensor_parallel_matches_one_rank(tmp_path_factory):
    """TP=2 over gloo: each rank holds half of every expert's intermediate dimension (and of the
    dense layer's), the experts' partial sums summed by the next norm; greedy tokens equal one
    rank's, with chunked prefill and prefix hits, and transformers'."""
    from tests.test_parallel import ARGS, completions, workload
    path, hf_model = make_tiny_model("qwen3_moe", tmp_path_factory)
    prompts = workload()
    expected = completions(LLM(path, **ARGS), prompts)
    llm = LLM(path, tensor_parallel_size=2, **ARGS)
    assert completions(llm, prompts) == expected
    assert completions(llm, prompts[::-1]) == expected[::-1]
    check_against_hf(llm, hf_model, prompts[:3])


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_expert_parallel_matches_one_rank(arch, tmp_path_factory):
    """enable_expert_parallel with TP=2 over gloo: each rank holds half of the experts whole (the
    attention and dense layers split as with TP), the other rank's pairs skipped; greedy tokens
    equal one rank's, with chunked prefill and prefix hits, and transformers'."""
    from nanovllm.layers.fused_moe import FusedMoE
    from tests.test_parallel import ARGS, completions, workload
    path, hf_model = make_tiny_model(arch, tmp_path_factory)
    prompts = workload()
    expected = completions(LLM(path, **ARGS), prompts)
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, **ARGS)
    experts = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, FusedMoE)]  # rank 0's
    num_experts = hf_model.config.num_experts
    assert experts and all(m.w13_weight.size(0) == num_experts // 2 and m.first_expert == 0 and
                           m.intermediate_size == m.w2_weight.size(2) == hf_model.config.to_dict().get(
                               "moe_intermediate_size", hf_model.config.intermediate_size) for m in experts)
    assert completions(llm, prompts) == expected
    check_against_hf(llm, hf_model, prompts[:3])
