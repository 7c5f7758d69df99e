"""LoRA requests, where vLLM keeps them (vllm.lora.request)."""
