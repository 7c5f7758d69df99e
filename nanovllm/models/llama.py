from nanovllm.models.qwen3 import Qwen3ForCausalLM


class LlamaForCausalLM(Qwen3ForCausalLM):
    """Llama 2/3 (and SmolLM): no q/k norm, no bias; rope scaling comes from the config."""
    qkv_bias = False
    qk_norm = False
