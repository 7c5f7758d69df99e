import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels in Triton's interpreter (set before triton imports)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

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


@pytest.fixture(scope="session", params=list(TINY))
def tiny_model(request, tmp_path_factory):
    """(directory, transformers model) of a tiny random model of each architecture, saved as safetensors."""
    return make_tiny_model(request.param, tmp_path_factory)


_CACHE = {}


def make_tiny_model(arch, tmp_path_factory):
    if arch not in _CACHE:
        config_cls, model_cls, extra = TINY[arch]
        torch.manual_seed(1234)
        model = model_cls(config_cls(**COMMON, **extra)).eval()
        if arch == "qwen2":  # random biases, so that loading them is checked
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.3)
        path = tmp_path_factory.mktemp(arch)
        model.save_pretrained(path)
        _CACHE[arch] = (str(path), model)
    return _CACHE[arch]


@pytest.fixture(scope="session")
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
