"""The supported architectures: decoder.py is the decoder-only transformer of Qwen3, Qwen2/2.5
and Llama (they differ only in biases and the per-head q/k norms); moe.py makes some or all of its
MLPs mixtures of experts (Qwen3-MoE, Mixtral); registry.py maps a Hugging Face `architectures`
name to its class; configs/ holds the configs usable with load_format="dummy".
To add a model, write its module here (or subclass the decoder) and name it in registry.py.
"""
