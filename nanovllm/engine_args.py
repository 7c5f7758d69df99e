"""EngineArgs: the engine arguments a user passes (vLLM's names, defaults and meanings), declared
once here; config.py's Config.create validates them and resolves them into the Config the engine
reads (the same fields, every "auto" decided, plus what the model's files give)."""
import difflib
import importlib.util
import os
from dataclasses import dataclass, fields

import torch

from nanovllm.layers.attention import BACKENDS
from nanovllm.loader.source import LOAD_FORMATS

DTYPES = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float": torch.float32}
DEVICES = ("auto", "cuda", "cpu")
ATTENTION_BACKENDS = ("auto", *BACKENDS)
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}  # and "auto"
GRAMMAR_BACKENDS = {"guidance": "llguidance", "xgrammar": "xgrammar"}  # structured outputs' backends -> packages
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3", "replay")
DRAFT_METHODS = ("draft_model", "eagle3")  # the methods that take a "model"


@dataclass(frozen=True)
class SpeculativeConfig:
    """speculative_config resolved (vLLM's keys and defaults). method: "ngram" (prompt lookup),
    "draft_model" (inferred when `model` is given), "eagle3" (`model` an EAGLE-3 head that reads
    the target's hidden states) or "replay" (testing and benchmarks only: the
    engine's own earlier greedy run of the same prompt, each draft token kept with probability
    acceptance_rate, else replaced, and the kept ones before the first replaced one accepted:
    synthetic acceptance). num_speculative_tokens: k >= 1 drafts a
    sequence verifies per step. prompt_lookup_max/min: the longest and shortest suffix n-gram the
    n-gram proposer looks up (vLLM: both 5 when neither is given, one when only the other is).
    disable_by_batch_size: no speculation in a step while more requests than this are unfinished
    (running and waiting): nanovllm's default 32 (vLLM's: never), since a verify step pays off at
    small batches only; None: never disabled."""
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = 32
    acceptance_rate: float | None = None

    @classmethod
    def from_dict(cls, spec) -> "SpeculativeConfig":
        """ValueError naming the key that is wrong and what it allows."""
        if isinstance(spec, cls):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict such as {{\"method\": \"ngram\", "
                             f"\"num_speculative_tokens\": 4}}, got {spec!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(spec) - set(known))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; it takes {known}")
        spec = dict(spec)
        method = spec.setdefault("method", "draft_model" if spec.get("model") is not None else None)
        if method not in SPECULATIVE_METHODS:
            allowed = ('"ngram", "draft_model" or "eagle3" (a "model" alone means a draft model; "replay" is a '
                       'synthetic proposer for benchmarks)')
            if method is None:
                raise ValueError(f"speculative_config needs a method: {allowed}")
            raise ValueError(f"speculative_config method {method!r} is not supported: use {allowed}")
        if (method in DRAFT_METHODS) != (spec.get("model") is not None):
            raise ValueError(f"speculative_config: a \"model\" goes with methods {' and '.join(DRAFT_METHODS)}, "
                             f"which need one; got method {method!r} and model {spec.get('model')!r}")
        k = spec.get("num_speculative_tokens")
        if not _positive_int(k):
            raise ValueError(f"speculative_config num_speculative_tokens must be a positive integer, got {k!r}")
        if method == "ngram":
            lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
            lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
            if not (_positive_int(lo) and _positive_int(hi) and lo <= hi):
                raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max (integers), "
                                 f"got {lo!r} and {hi!r}")
            spec.update(prompt_lookup_min=lo, prompt_lookup_max=hi)
        elif spec.get("prompt_lookup_min") is not None or spec.get("prompt_lookup_max") is not None:
            raise ValueError(f"speculative_config prompt_lookup_min/max are for method \"ngram\", not {method!r}")
        rate = spec.get("acceptance_rate")
        if (method == "replay") != (rate is not None) or (rate is not None and not (
                isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 <= rate <= 1)):
            raise ValueError(f"speculative_config acceptance_rate, a number in [0, 1], goes with method \"replay\" "
                             f"(and it needs one), got {rate!r} with method {method!r}")
        bs = spec.get("disable_by_batch_size", 32)
        if bs is not None and not (_positive_int(bs) and bs >= 2):
            raise ValueError(f"speculative_config disable_by_batch_size must be None or an integer >= 2, got {bs!r}")
        return cls(**spec)


# vLLM engine arguments that nanovllm does not take, and why (named in the TypeError)
VLLM_ONLY_ARGS = {
    "enable_chunked_prefill": "prefill is always chunked, to max_num_batched_tokens a step",
    "swap_space": "a preempted sequence is recomputed, never swapped to the CPU",
    "cpu_offload_gb": "weights stay on the GPU",
    "tokenizer_mode": "transformers' tokenizer of the model, or of the tokenizer argument, is used",
    "revision": "a hub model is fetched at its default revision; pass a local directory for another",
    "download_dir": "hub models go to Hugging Face's cache (HF_HOME)",
    "hf_overrides": "the model's config.json is read as it is",
    "compilation_config": "there is no torch.compile; decode steps run in CUDA graphs unless enforce_eager",
    "max_seq_len_to_capture": "CUDA graphs serve decode steps at any context length",
    "disable_log_stats": "the engine logs no statistics; get_metrics() returns them",
    "scheduling_policy": "requests are scheduled first come, first served",
    "task": "nanovllm runs generative models only (no pooling, embedding or scoring)",
    "runner": "nanovllm runs generative models only (no pooling, embedding or scoring)",
    "async_scheduling": "steps already overlap: the next one is launched before the last one's tokens are read",
    "num_gpu_blocks_override": "num_kvcache_blocks sets the KV cache's block count",
    "tokenizer_revision": "a hub tokenizer is fetched at its default revision; pass a local directory for another",
    "model_impl": "the models are nanovllm's own (nanovllm/models); there is no transformers fallback",
}


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


_DEFAULT_BLOCK_SIZE = 256


@dataclass
class EngineArgs:
    """vLLM's engine arguments, with its names and meanings (those nanovllm has), as LLM(model,
    **engine_args) and LLMEngine.from_engine_args(EngineArgs(model=..., ...)) take them; Config.create
    validates and resolves them.

    model: local directory, hub id, .gguf file, or a builtin config name with load_format="dummy".
    max_num_seqs: most sequences in one step. max_num_batched_tokens: most tokens in one step
    (longer prompts are prefilled in chunks). max_model_len: most tokens (prompt + completion) per
    sequence; default the model's max_position_embeddings. gpu_memory_utilization: fraction of GPU
    memory the engine may use (weights, activations, KV cache). kvcache_block_size (or vLLM's name,
    block_size): tokens per KV block.
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
    sampling (None: a random seed, so unseeded requests differ from run to run).
    tensor_parallel_size: GPUs (or CPU processes) one model is split across.
    enable_expert_parallel: with tensor_parallel_size > 1, a mixture-of-experts layer's experts are
    placed whole on the ranks (num_experts / tensor_parallel_size each) rather than each expert's
    intermediate dimension split over them (vLLM's name); attention and dense layers stay split.
    data_parallel_size: engine replicas, each on its own tensor_parallel_size GPUs, that share the
    prompts of a generate call. generation_config: "auto" (the model's generation_config.json gives
    the default SamplingParams' temperature, top_p, top_k, min_p, repetition_penalty, and its
    max_new_tokens their max_tokens) or "vllm" (vLLM's defaults). When max_model_len is left unset
    and the model's maximum does not fit the KV cache, the engine lowers it to what fits (and logs
    it). logprobs_mode: "raw_logprobs" (the model's log-softmax) or "processed_logprobs" (of the
    logits sampled from: after penalties, bias, masks, temperature and filters). max_logprobs: the
    most logprobs or prompt_logprobs a request may ask for (vLLM's default 20; -1: no limit).
    distributed_executor_backend: where data-parallel replicas run: "mp" (processes of this host)
    or "ray" (actors on the Ray cluster, nanovllm/executor/ray_replicas.py).
    trust_remote_code: let transformers run the model folder's own Python code for its config and
    tokenizer (vLLM's meaning); the model itself must still be an architecture nanovllm implements.
    tokenizer: a tokenizer folder or hub id to use instead of the model's (e.g. the original
    model's beside a .gguf file, as vLLM advises for GGUF); None: the model's own.
    skip_tokenizer_init: load no tokenizer: prompts are token ids, and completions have no text.
    enable_prefix_caching: None is vLLM's default, on.
    enable_lora: serve PEFT LoRA adapters (generate(..., lora_request=...)); max_loras: adapters in
    one step (their slots on the device); max_lora_rank: the largest adapter rank; max_cpu_loras:
    adapters kept on the host (default max_loras, at least as many).
    speculative_config: speculative decoding (vLLM's dict, SpeculativeConfig's keys), e.g.
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    or {"model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 4}; None: off. Beside a
    tensor-parallel target a draft model runs whole on rank 0, and with LoRA it drafts without
    adapters (the target verifies with them).
    structured_outputs_config: {"backend": "auto" | "guidance" | "xgrammar"}, the grammar library
    behind SamplingParams.structured_outputs: "guidance" (llguidance), "xgrammar", or "auto"
    (llguidance when installed, else xgrammar; nanovllm/sampling/structured says why).
    """
    model: str
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kvcache_block_size: int = _DEFAULT_BLOCK_SIZE
    num_kvcache_blocks: int | None = None
    cpu_kvcache_space_gib: float = 4.0
    enable_prefix_caching: bool | None = True
    enforce_eager: bool = False
    dtype: str | torch.dtype = "auto"
    kv_cache_dtype: str | torch.dtype = "auto"
    quantization: str | None = None
    device: str | torch.device = "auto"
    load_format: str = "auto"
    attention_backend: str = "auto"
    seed: int | None = 0
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1
    generation_config: str = "auto"
    logprobs_mode: str = "raw_logprobs"
    max_logprobs: int = 20
    distributed_executor_backend: str = "mp"
    trust_remote_code: bool = False
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    speculative_config: dict | SpeculativeConfig | None = None
    structured_outputs_config: dict | None = None
    block_size: int | None = None

    def __post_init__(self):
        if self.block_size is not None:  # vLLM's name for kvcache_block_size
            if self.kvcache_block_size not in (self.block_size, _DEFAULT_BLOCK_SIZE):
                raise ValueError(f"block_size={self.block_size} and kvcache_block_size={self.kvcache_block_size} "
                                 f"are two names for one argument: set one")
            self.kvcache_block_size = self.block_size

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineArgs":
        """EngineArgs(model, **kwargs), LLM(model, **kwargs)'s; raises TypeError for a name it does
        not take, saying why for vLLM's arguments that nanovllm has no use for (VLLM_ONLY_ARGS) and
        naming the closest argument for others (a misspelling)."""
        names = {f.name for f in fields(cls)}
        for name in kwargs:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                why = f": {VLLM_ONLY_ARGS[name]}" if name in VLLM_ONLY_ARGS else \
                    f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"nanovllm takes no engine argument {name!r}{why}")
        return cls(model, **kwargs)

    def validate(self):
        """Raise ValueError naming the first argument that is wrong and what it allows (what needs
        the model, such as max_model_len against its positions, is Config.create's). A torch dtype
        for dtype or kv_cache_dtype (as vLLM takes) becomes its name."""
        for name, names in (("dtype", DTYPES), ("kv_cache_dtype", KV_CACHE_DTYPES)):
            value = getattr(self, name)
            if isinstance(value, torch.dtype):
                setattr(self, name, next((key for key, dtype in names.items() if dtype == value), value))
        for name in ("max_num_seqs", "max_num_batched_tokens", "kvcache_block_size", "tensor_parallel_size",
                     "data_parallel_size", "max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_model_len", "num_kvcache_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for no limit, got {self.max_logprobs!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None (a random one), got {self.seed!r}")
        if self.tokenizer is not None and not isinstance(self.tokenizer, (str, os.PathLike)):
            raise ValueError(f"tokenizer must be a folder or hub id (a string) or None, got {self.tokenizer!r}")
        if self.enable_prefix_caching is None:  # vLLM's default: on for generative models
            self.enable_prefix_caching = True
        for name in ("trust_remote_code", "enable_lora", "enable_expert_parallel", "enable_prefix_caching",
                     "enforce_eager", "skip_tokenizer_init"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        cpu_loras = self.max_cpu_loras
        if cpu_loras is not None and (not isinstance(cpu_loras, int) or isinstance(cpu_loras, bool)
                                      or cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be None or an integer >= max_loras={self.max_loras}, "
                             f"got {cpu_loras!r}")
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
        if self.speculative_config is not None:
            self._validate_speculative_config()
        self._validate_structured_outputs_config()
        if self.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError('distributed_executor_backend="ray" needs Ray: pip install "nanovllm[ray]"')
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available; use device='cpu' or 'auto'")
        gpus = self.tensor_parallel_size * self.data_parallel_size
        on_gpu = self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
        if on_gpu and gpus > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} x data_parallel_size="
                             f"{self.data_parallel_size} needs {gpus} GPUs, but {torch.cuda.device_count()} are visible")


    def _validate_speculative_config(self):
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        if spec.num_speculative_tokens >= self.max_num_batched_tokens:
            raise ValueError(f"speculative_config num_speculative_tokens={spec.num_speculative_tokens} leaves no room in "
                             f"a step of max_num_batched_tokens={self.max_num_batched_tokens}")
        if spec.method == "eagle3" and self.tensor_parallel_size > 1:  # its hidden states would be partial sums
            raise ValueError(f"speculative_config method \"eagle3\" runs with tensor_parallel_size=1, got "
                             f"{self.tensor_parallel_size}; use method \"draft_model\" or \"ngram\" with tensor parallelism")

    def _validate_structured_outputs_config(self):
        config = self.structured_outputs_config
        if config is None:
            return
        if not isinstance(config, dict):
            raise ValueError(f'structured_outputs_config must be a dict with the key "backend", got {config!r}')
        if set(config) - {"backend"}:  # vLLM's other keys: their per-request forms are StructuredOutputsParams'
            raise ValueError(f"structured_outputs_config takes only \"backend\", got {sorted(set(config) - {'backend'})}; "
                             f"disable_any_whitespace, disable_additional_properties and whitespace_pattern are "
                             f"StructuredOutputsParams' fields here")
        backend = config.get("backend", "auto")
        if backend not in ("auto", *GRAMMAR_BACKENDS):
            raise ValueError(f"structured_outputs_config backend must be one of {['auto', *GRAMMAR_BACKENDS]}, "
                             f"got {backend!r}")
        if backend != "auto" and importlib.util.find_spec(GRAMMAR_BACKENDS[backend]) is None:
            raise ValueError(f"structured_outputs_config backend {backend!r} needs its package: "
                             f"pip install {GRAMMAR_BACKENDS[backend]}")
