"""The models' building blocks, as torch modules: tensor-parallel linear layers whose products go
through a LinearMethod (linear.py, linear_method.py; LoRA adapters' wrapper: lora.py),
mixture-of-experts layers' stacked experts and routing, computed through a MoEMethod
(fused_moe.py, moe_method.py), the vocabulary-parallel embedding and LM head (embed_head.py),
RMSNorm (layernorm.py), the rotary embedding, and paged attention with its backends (attention/).
Each takes its TensorParallel rank and size when built; the kernels they run are
nanovllm/kernels'.
"""
