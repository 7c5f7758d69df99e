"""Engine arguments (vLLM's names and meanings), validated and resolved once into a frozen Config.

`Config.create(model, **engine_args)` is the one place where every option is checked and every
"auto" is decided: the model's local path and load format, its Hugging Face config and
tokenizer, dtype, device, attention backend, max_model_len and the EOS ids. The rest of the
engine reads the result and never re-derives any of it.
"""
import importlib.util
from dataclasses import dataclass, field, fields, replace

import torch

from nanovllm.layers.attention import BACKENDS
from nanovllm.loader.source import (LOAD_FORMATS, load_tokenizer, read_generation_defaults, read_hf_config,
                                    resolve_path)

DTYPES = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float": torch.float32}
DEVICES = ("auto", "cuda", "cpu")
ATTENTION_BACKENDS = ("auto", *BACKENDS)
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}  # and "auto"
RESOLVED = ("hf_config", "tokenizer", "eos_token_ids", "generation_defaults", "max_model_len_is_default")  # set by create(), not engine arguments


@dataclass(frozen=True)
class Config:
    """model: local directory, hub id, .gguf file, or a builtin config name with load_format="dummy".
    max_num_seqs: most sequences in one step. max_num_batched_tokens: most tokens in one step
    (longer prompts are prefilled in chunks). max_model_len: most tokens (prompt + completion) per
    sequence; default the model's max_position_embeddings. gpu_memory_utilization: fraction of GPU
    memory the engine may use (weights, activations, KV cache). kvcache_block_size: tokens per KV block.
    num_kvcache_blocks: KV pool size, overriding the memory-based sizing. cpu_kvcache_space_gib: KV
    pool size on CPU (as vLLM's VLLM_CPU_KVCACHE_SPACE). enforce_eager: no CUDA graphs.
    dtype: "auto" (the checkpoint's bf16/fp16 on GPU, float32 on CPU), "bfloat16", "float16", "float32".
    kv_cache_dtype: "auto" (the model dtype), "fp8" or "fp8_e4m3" (float8 e4m3 with a float32
    scale per token and KV head: ~1.9x the tokens in the same memory). quantization: None, or "fp8"
    (the linear layers' weights in float8 e4m3 with a scale per output channel, activations
    quantized per token; the default for a checkpoint whose quantization_config says fp8). device:
    "auto" (CUDA when available), "cuda", "cpu".
    load_format: "auto", "safetensors", "gguf", "dummy" (random weights). attention_backend: "auto"
    (Triton on CUDA, torch otherwise), "triton", "torch". seed: seeds dummy weights and unseeded
    sampling. tensor_parallel_size: GPUs (or CPU processes) one model is split across.
    data_parallel_size: engine replicas, each on its own tensor_parallel_size GPUs, that share the
    prompts of a generate call. generation_config: "auto" (the model's generation_config.json gives
    the default SamplingParams' temperature, top_p, top_k, min_p and repetition_penalty) or
    "vllm" (vLLM's defaults). When max_model_len is left unset and the model's maximum does not
    fit the KV cache, the engine lowers it to what fits (and logs it). logprobs_mode: "raw_logprobs"
    (the model's log-softmax) or "processed_logprobs" (of the logits sampled from: after penalties,
    bias, masks, temperature and filters). max_logprobs: the most logprobs or prompt_logprobs a
    request may ask for (vLLM's default 20; -1: no limit). distributed_executor_backend: where data-parallel replicas
    run: "mp" (processes of this host) or "ray" (actors on the Ray cluster, nanovllm/executor/ray_replicas.py).
    trust_remote_code: let transformers run the model folder's own Python code for its config and
    tokenizer (vLLM's meaning); the model itself must still be an architecture nanovllm implements.
    structured_outputs_config: {"backend": "auto" | "guidance" | "xgrammar"}, the grammar library
    behind SamplingParams.structured_outputs: "guidance" (llguidance), "xgrammar", or "auto"
    (llguidance when installed, else xgrammar; nanovllm/sampling/structured says why).

    After `create`, model is a local path, dtype and kv_cache_dtype torch.dtypes, device a torch.device, load_format,
    attention_backend and max_model_len concrete, and hf_config, tokenizer and eos_token_ids set.
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
    dtype: str | torch.dtype = "auto"
    kv_cache_dtype: str | torch.dtype = "auto"
    quantization: str | None = None
    device: str | torch.device = "auto"
    load_format: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    generation_config: str = "auto"
    logprobs_mode: str = "raw_logprobs"
    max_logprobs: int = 20
    distributed_executor_backend: str = "mp"
    trust_remote_code: bool = False
    structured_outputs_config: dict | None = field(default=None, compare=False)  # a dict: unhashable
    # resolved by create()
    hf_config: object = field(default=None, repr=False)
    tokenizer: object = field(default=None, repr=False, compare=False)
    eos_token_ids: frozenset = frozenset()
    generation_defaults: dict = field(default_factory=dict, compare=False)
    max_model_len_is_default: bool = False  # then the engine may lower it to what the KV cache holds

    @classmethod
    def create(cls, model: str, with_tokenizer: bool = True, **engine_args) -> "Config":
        """Validate engine_args, resolve the model and every "auto". with_tokenizer=False skips loading
        it (tensor-parallel workers need none). Raises TypeError for an unknown argument,
        ValueError naming the argument and what is allowed, FileNotFoundError for a missing model."""
        unknown = set(engine_args) - {f.name for f in fields(cls)} | set(engine_args) & set(RESOLVED)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {sorted(unknown)}")
        args = cls(model, **engine_args)
        args._validate()
        path, load_format = resolve_path(args.model, args.load_format)
        hf_config = read_hf_config(path, load_format, args.trust_remote_code)
        _check_tensor_parallel(hf_config, args.tensor_parallel_size)
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                              else "cpu" if args.device == "auto" else args.device)
        tok = load_tokenizer(path, load_format, hf_config, args.trust_remote_code) if with_tokenizer else None
        dtype = _resolve_dtype(args.dtype, device, hf_config)
        backend = _resolve_backend(args.attention_backend, device, _head_dim(hf_config))
        return replace(args, model=path, load_format=load_format, hf_config=hf_config, tokenizer=tok, device=device,
                       dtype=dtype, kv_cache_dtype=_resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, device, backend),
                       quantization=_resolve_quantization(args.quantization, hf_config, device),
                       attention_backend=backend,
                       max_model_len=_resolve_max_model_len(args.max_model_len, hf_config),
                       eos_token_ids=_eos_token_ids(hf_config, tok), max_model_len_is_default=args.max_model_len is None,
                       generation_defaults=read_generation_defaults(path, load_format)
                       if args.generation_config == "auto" else {},
                       structured_outputs_config={"backend": _resolve_grammar_backend(args.structured_outputs_config)})

    def _validate(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "kvcache_block_size", "tensor_parallel_size",
                     "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_model_len", "num_kvcache_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for no limit, got {self.max_logprobs!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.trust_remote_code, bool):
            raise ValueError(f"trust_remote_code must be True or False, got {self.trust_remote_code!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.cpu_kvcache_space_gib > 0:
            raise ValueError(f"cpu_kvcache_space_gib must be > 0, got {self.cpu_kvcache_space_gib}")
        for name, allowed in (("dtype", ("auto", *DTYPES)), ("kv_cache_dtype", ("auto", *KV_CACHE_DTYPES)),
                              ("device", DEVICES), ("load_format", LOAD_FORMATS), ("attention_backend", ATTENTION_BACKENDS),
                              ("generation_config", ("auto", "vllm")), ("quantization", (None, "fp8")),
                              ("logprobs_mode", ("raw_logprobs", "processed_logprobs")),
                              ("distributed_executor_backend", ("mp", "ray"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        _check_structured_outputs_config(self.structured_outputs_config)
        if self.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError('distributed_executor_backend="ray" needs Ray: pip install "nanovllm[ray]"')
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available; use device='cpu' or 'auto'")
        gpus = self.tensor_parallel_size * self.data_parallel_size
        on_gpu = self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
        if on_gpu and gpus > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} x data_parallel_size="
                             f"{self.data_parallel_size} needs {gpus} GPUs, but {torch.cuda.device_count()} are visible")


GRAMMAR_BACKENDS = {"guidance": "llguidance", "xgrammar": "xgrammar"}  # name -> its package


def _check_structured_outputs_config(config):
    if config is None:
        return
    if not isinstance(config, dict) or set(config) - {"backend"}:
        raise ValueError(f'structured_outputs_config must be a dict with the key "backend", got {config!r}')
    backend = config.get("backend", "auto")
    if backend not in ("auto", *GRAMMAR_BACKENDS):
        raise ValueError(f"structured_outputs_config backend must be one of {['auto', *GRAMMAR_BACKENDS]}, "
                         f"got {backend!r}")
    if backend != "auto" and importlib.util.find_spec(GRAMMAR_BACKENDS[backend]) is None:
        raise ValueError(f"structured_outputs_config backend {backend!r} needs its package: "
                         f"pip install {GRAMMAR_BACKENDS[backend]}")


def _resolve_grammar_backend(config: dict | None) -> str | None:
    """The backend asked for, or for "auto" the first of GRAMMAR_BACKENDS installed (None: neither;
    a request with structured_outputs then gets a ValueError naming them)."""
    backend = (config or {}).get("backend", "auto")
    if backend == "auto":
        return next((name for name, package in GRAMMAR_BACKENDS.items() if importlib.util.find_spec(package)), None)
    return backend


def _head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def _resolve_dtype(dtype, device: torch.device, hf_config) -> torch.dtype:
    """"auto": float32 on CPU; on GPU the checkpoint's float16/bfloat16, else bfloat16."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def _resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device, backend: str) -> torch.dtype:
    """"auto": the model dtype. The Triton kernels convert float8 e4m3 in hardware from compute
    capability 8.9 (Ada, Hopper) on; older GPUs get a ValueError naming the way out."""
    if name == "auto":
        return dtype
    if device.type == "cuda" and backend == "triton" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"kv_cache_dtype={name!r} needs a GPU of compute capability 8.9 or newer (Ada, Hopper), "
                         f"this one has {torch.cuda.get_device_capability(device)}; use kv_cache_dtype='auto'")
    return KV_CACHE_DTYPES[name]


def _resolve_quantization(name: str | None, hf_config, device: torch.device) -> str | None:
    """None (weights in the model dtype) or "fp8": asked for, or named by the checkpoint's
    quantization_config (quant_method "fp8", e.g. Qwen3-*-FP8: loaded dequantized, then quantized
    per channel, layers/linear_method.py). ValueError for another checkpoint quantization, and on a GPU
    without float8 matrix cores (before compute capability 8.9)."""
    qc = getattr(hf_config, "quantization_config", None) or {}
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if method not in (None, "fp8"):
        raise ValueError(f"the checkpoint is quantized with {method!r}; nanovllm loads unquantized and fp8 "
                         f"checkpoints only")
    name = name or method
    if name and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"quantization={name!r} needs a GPU of compute capability 8.9 or newer (Ada, Hopper), "
                         f"this one has {torch.cuda.get_device_capability(device)}; use an unquantized checkpoint")
    return name


def _resolve_backend(name: str, device: torch.device, head_dim: int) -> str:
    """"auto" picks Triton on CUDA (when triton imports and head_dim is a power of two >= 16),
    torch otherwise. "triton" on CPU needs TRITON_INTERPRET=1."""
    has_triton = importlib.util.find_spec("triton") is not None
    triton_ok = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    if name == "auto":
        return "triton" if device.type == "cuda" and has_triton and triton_ok else "torch"
    if name == "triton" and not has_triton:
        raise ValueError("attention_backend='triton' needs the triton package")
    if name == "triton" and not triton_ok:
        raise ValueError(f"attention_backend='triton' needs head_dim a power of two >= 16, got {head_dim}")
    return name


def _resolve_max_model_len(max_model_len: int | None, hf_config) -> int:
    max_pos = hf_config.max_position_embeddings
    if max_model_len is not None and max_model_len > max_pos:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={max_pos}")
    return max_model_len or max_pos


def _eos_token_ids(hf_config, tokenizer) -> frozenset:
    """The config's eos_token_id (an id or a list) and the tokenizer's."""
    ids = getattr(hf_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _check_tensor_parallel(hf_config, tp_size: int):
    """Raise ValueError unless the model splits evenly over tp_size ranks: query heads and the
    intermediate size divisible by it, and KV heads either divisible by it or dividing it (then
    each KV head is replicated on tp_size / num_key_value_heads ranks)."""
    if tp_size == 1:
        return
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % tp_size or hf_config.intermediate_size % tp_size or (kv_heads % tp_size and tp_size % kv_heads):
        raise ValueError(f"tensor_parallel_size={tp_size} does not split this model: it needs to divide "
                         f"num_attention_heads={heads} and intermediate_size={hf_config.intermediate_size}, and "
                         f"to divide or be a multiple of num_key_value_heads={kv_heads}")
