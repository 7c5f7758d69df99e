from nanovllm.models.qwen3 import Qwen3ForCausalLM


class Qwen2ForCausalLM(Qwen3ForCausalLM):
    """Qwen2 / Qwen2.5: bias on the q, k, v projections, no q/k norm."""
    qkv_bias = True
    qk_norm = False
