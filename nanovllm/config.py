"""Config: the engine arguments (engine_args.EngineArgs), validated and resolved once.

`Config.create(engine_args)` is the one place where every argument is checked and every "auto"
is decided: the model's local path and load format, its Hugging Face config and tokenizer,
dtype, device, attention backend, max_model_len and the EOS ids. The rest of the engine reads
the result and never re-derives any of it.
"""
import importlib.util
import logging
import random
from dataclasses import dataclass, field, fields

import torch

from nanovllm.engine_args import DTYPES, GRAMMAR_BACKENDS, KV_CACHE_DTYPES, EngineArgs, SpeculativeConfig
from nanovllm.loader.source import (generation_defaults, load_tokenizer, read_generation_config, read_hf_config,
                                    resolve_path)

logger = logging.getLogger(__name__)


@dataclass
class Config(EngineArgs):
    """EngineArgs resolved: model a local path, dtype and kv_cache_dtype torch.dtypes, device a
    torch.device, load_format, quantization, attention_backend, max_model_len and
    structured_outputs_config's backend ("guidance", "xgrammar", or None: neither installed)
    concrete, speculative_config a SpeculativeConfig or None; and
    what the model's files give: hf_config, tokenizer, eos_token_ids, generation_defaults (the
    default SamplingParams' fields). Made by create(); the engine reads it and changes copies of
    it only (dataclasses.replace)."""
    hf_config: object = field(default=None, repr=False)
    tokenizer: object = field(default=None, repr=False, compare=False)
    eos_token_ids: frozenset = frozenset()
    generation_defaults: dict = field(default_factory=dict, compare=False)
    max_model_len_is_default: bool = False  # then the engine may lower it to what the KV cache holds

    @classmethod
    def create(cls, args: EngineArgs, with_tokenizer: bool = True) -> "Config":
        """Validate the engine arguments, resolve the model and every "auto". with_tokenizer=False
        skips loading it (tensor-parallel workers need none). Raises ValueError naming the argument
        and what is allowed, FileNotFoundError for a missing model."""
        args.validate()
        path, load_format = resolve_path(args.model, args.load_format)
        hf_config = read_hf_config(path, load_format, args.trust_remote_code)
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                              else "cpu" if args.device == "auto" else args.device)
        tok = load_tokenizer(path, load_format, hf_config, args.trust_remote_code, args.tokenizer) \
            if with_tokenizer and not args.skip_tokenizer_init else None
        dtype = _resolve_dtype(args.dtype, device, hf_config)
        backend = _resolve_backend(args.attention_backend, device, _head_dim(hf_config))
        if device.type == "cpu" and args.gpu_memory_utilization != _default("gpu_memory_utilization"):
            sizing = ("num_kvcache_blocks" if args.num_kvcache_blocks is not None else
                      f"cpu_kvcache_space_gib={args.cpu_kvcache_space_gib}")
            logger.warning("gpu_memory_utilization=%s does not apply on the CPU: %s sizes the KV cache",
                           args.gpu_memory_utilization, sizing)
        resolved = dict(model=path, load_format=load_format, device=device, dtype=dtype,
                        kv_cache_dtype=_resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, device, backend),
                        quantization=_resolve_quantization(args.quantization, hf_config, device),
                        attention_backend=backend, max_model_len=_resolve_max_model_len(args.max_model_len, hf_config),
                        max_cpu_loras=args.max_cpu_loras or args.max_loras,
                        seed=random.SystemRandom().getrandbits(31) if args.seed is None else args.seed, tokenizer=tok,
                        speculative_config=args.speculative_config and SpeculativeConfig.from_dict(args.speculative_config),
                        structured_outputs_config={"backend": _resolve_grammar_backend(args.structured_outputs_config)})
        generation_config = read_generation_config(path, load_format)
        return cls(**{f.name: getattr(args, f.name) for f in fields(EngineArgs)} | resolved, hf_config=hf_config,
                   eos_token_ids=_eos_token_ids(hf_config, tok, generation_config),
                   max_model_len_is_default=args.max_model_len is None,
                   generation_defaults=generation_defaults(generation_config)
                   if args.generation_config == "auto" else {})


def _default(name: str):
    """EngineArgs' default for argument `name`."""
    return next(f.default for f in fields(EngineArgs) if f.name == name)


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


def _eos_token_ids(hf_config, tokenizer, generation_config: dict) -> frozenset:
    """The eos_token_id (an id or a list) of the config and of generation_config.json, and the
    tokenizer's: Qwen3's generation config adds <|endoftext|> to config.json's <|im_end|>, and
    vLLM stops at both whatever its generation_config argument (SamplingParams.
    update_from_generation_config)."""
    ids = set()
    for value in (getattr(hf_config, "eos_token_id", None), generation_config.get("eos_token_id")):
        ids.update(value if isinstance(value, (list, tuple)) else [] if value is None else [value])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
