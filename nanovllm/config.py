"""Engine arguments; names and meanings follow vLLM's EngineArgs."""
from dataclasses import dataclass

import torch

DTYPES = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float": torch.float32}


@dataclass
class Config:
    """model: local directory, hub id, .gguf file, or a builtin config name with load_format="dummy".
    max_num_seqs: most sequences in one step. max_num_batched_tokens: most tokens in one step
    (longer prompts are prefilled in chunks). max_model_len: most tokens (prompt + completion) per
    sequence; default the model's max_position_embeddings. gpu_memory_utilization: fraction of GPU
    memory the engine may use (weights, activations, KV cache). kvcache_block_size: tokens per KV block.
    num_kvcache_blocks: KV pool size, overriding the memory-based sizing. cpu_kvcache_space_gib: KV
    pool size on CPU (as vLLM's VLLM_CPU_KVCACHE_SPACE). enforce_eager: no CUDA graphs.
    dtype: "auto" (the checkpoint's bf16/fp16 on GPU, float32 on CPU), "bfloat16", "float16", "float32".
    device: "auto" (CUDA when available), "cuda", "cpu". attention_backend: "auto", "torch", ...
    seed: seeds dummy weights and unseeded sampling. tensor_parallel_size: GPUs (or CPU processes)
    one model is split across. data_parallel_size: engine replicas, each on its own
    tensor_parallel_size GPUs, that share the prompts of a generate call.
    """
    model: str
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kvcache_block_size: int = 256
    num_kvcache_blocks: int | None = None
    cpu_kvcache_space_gib: float = 4.0
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self):
        positive = ("max_num_seqs", "max_num_batched_tokens", "kvcache_block_size", "tensor_parallel_size",
                    "data_parallel_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_model_len", "num_kvcache_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available; use device='cpu' or 'auto'")
        gpus = self.tensor_parallel_size * self.data_parallel_size
        if self.torch_device.type == "cuda" and gpus > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} x data_parallel_size="
                             f"{self.data_parallel_size} needs {gpus} GPUs, but {torch.cuda.device_count()} are visible")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, hf_config) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.torch_device.type == "cpu":
            return torch.float32
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
