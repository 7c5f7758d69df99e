import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels in Triton's interpreter (set before triton imports)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

# the Triton backend on device="cpu" (the engine's CPU tests) runs only in Triton's interpreter
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton kernels take CPU tensors only in the interpreter "
                                              "(TRITON_INTERPRET=1, which conftest.py sets where there is no CUDA)")

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, rms_norm_eps=1e-6)
TINY = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "llama": (LlamaConfig, LlamaForCausalLM, dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
}
DENSE = list(TINY)
TINY_MOE = {
    # layers 0 and 2 sparse, 1 dense (mlp_only_layers); top-3 of 8 renormalised
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        num_hidden_layers=3, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=True, mlp_only_layers=[1], head_dim=16, tie_word_embeddings=True)),
    # decoder_sparse_step 2: layer 0 dense, layer 1 sparse; top-2 of 6 not renormalised
    "qwen3_moe_step2": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        moe_intermediate_size=48, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
        decoder_sparse_step=2, head_dim=16)),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(intermediate_size=32, num_local_experts=6, num_experts_per_tok=2)),
}
TINY |= TINY_MOE


@pytest.fixture(scope="package", params=DENSE)
def tiny_model(request, tmp_path_factory):
    """(directory, transformers model) of a tiny random model of each dense architecture, saved as safetensors."""
    return make_tiny_model(request.param, tmp_path_factory)


@pytest.fixture(scope="package", params=list(TINY))
def tiny_any_model(request, tmp_path_factory):
    """tiny_model's, and a tiny random mixture-of-experts model of each kind (TINY_MOE)."""
    return make_tiny_model(request.param, tmp_path_factory)


_CACHE = {}


def make_tiny_model(arch, tmp_path_factory):
    if arch not in _CACHE:
        config_cls, model_cls, extra = TINY[arch]
        torch.manual_seed(1234)
        model = model_cls(config_cls(**COMMON | extra)).eval()
        if arch == "qwen2":  # random biases, so that loading them is checked
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.3)
        path = tmp_path_factory.mktemp(arch)
        model.save_pretrained(path)
        _CACHE[arch] = (str(path), model)
    return _CACHE[arch]


@pytest.fixture(scope="package")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_model("qwen3", tmp_path_factory)


def random_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt, max_new_tokens):
    """transformers' greedy completion (token ids after the prompt), EOS ignored."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def cuda_random_model(builtin: str, model_cls, tmp_path_factory, **overrides):
    """(directory, the transformers model in bf16 on CUDA with random weights, its float32 twin) of
    a shipped config (loader.source.BUILTIN_CONFIGS[builtin], with overrides), saved as safetensors."""
    from transformers import AutoConfig

    from nanovllm.loader.source import BUILTIN_CONFIGS
    config = AutoConfig.from_pretrained(str(BUILTIN_CONFIGS[builtin]))
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_cls(config).to(torch.bfloat16).eval()
    path = tmp_path_factory.mktemp(builtin)
    model.save_pretrained(path)
    with torch.device("cuda"):
        exact = model_cls(config).eval()
    exact.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return str(path), model, exact
