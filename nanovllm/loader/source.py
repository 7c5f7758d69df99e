"""Turns the user's `model` argument into a local path, a load format, a Hugging Face config, a
tokenizer and a stream of checkpoint tensors.

Accepted: a local Hugging Face directory (config.json, *.safetensors, tokenizer files), a hub id
(downloaded with huggingface_hub), a `.gguf` file, or, with load_format="dummy", the name of a
config shipped with the package (e.g. "Qwen/Qwen3-0.6B") for random weights.
"""
import glob
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaConfig, PretrainedConfig

from nanovllm.kernels.fp8 import dequantize_blocks

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
CONFIG_DIR = Path(__file__).resolve().parent.parent / "models" / "configs"
BUILTIN_CONFIGS = {p.stem: p for p in CONFIG_DIR.glob("*.json")}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_path(model: str, load_format: str) -> tuple[str, str]:
    """(local path, concrete load format: "safetensors", "gguf" or "dummy") for `model` (see the
    module docstring); hub ids are downloaded. Raises FileNotFoundError for a missing path or
    config.json, ValueError for a file that is not a model (missing weights: safetensors_files)."""
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a path, a hub id or a builtin config name, got {type(model).__name__}")
    model = os.path.expanduser(str(model))
    if load_format == "dummy" and not os.path.exists(model):
        name = model.split("/")[-1].lower()
        if name not in BUILTIN_CONFIGS:
            raise FileNotFoundError(f"{model!r} is neither a directory nor a builtin config; builtin configs for "
                                    f"load_format='dummy': {', '.join(sorted(BUILTIN_CONFIGS))}")
        return str(BUILTIN_CONFIGS[name]), "dummy"
    if os.path.isfile(model) and (model.endswith(".gguf") or load_format == "gguf"):
        return os.path.abspath(model), "gguf"
    if not os.path.exists(model):
        model = _download(model)
    if not os.path.isdir(model):
        raise ValueError(f"{model} is a file but not a .gguf model; pass a model directory or a .gguf file")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise FileNotFoundError(f"{model} has no config.json; it is not a Hugging Face model directory")
    return model, "dummy" if load_format == "dummy" else "safetensors"


def read_hf_config(path: str, load_format: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """The model's config; ValueError when it cannot be read. trust_remote_code: transformers may run
    the model folder's own Python code for it. A speculators-format EAGLE-3 head's config
    (speculators_eagle3_config) becomes the LlamaForCausalLMEagle3 config it describes."""
    try:
        if load_format == "gguf":
            folder, name = os.path.split(path)
            return AutoConfig.from_pretrained(folder, gguf_file=name)
        with open(path if os.path.isfile(path) else os.path.join(path, "config.json")) as f:  # a file: a builtin
            raw = json.load(f)
        if "speculators_model_type" in raw:
            return speculators_eagle3_config(raw)
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        what = "GGUF file" if load_format == "gguf" else "config of"
        raise ValueError(f"cannot read {what} {path}: {e}") from None


def speculators_eagle3_config(raw: dict) -> PretrainedConfig:
    """The head's config from a speculators-format config.json (vLLM's reading of it): the layer's
    transformer_layer_config with the format's draft_vocab_size, target_hidden_size,
    eagle_aux_hidden_state_layer_ids and norm_before_residual (default True), as
    LlamaForCausalLMEagle3. ValueError for another speculators_model_type."""
    kind = raw.get("speculators_model_type")
    if kind != "eagle3" or not isinstance(raw.get("transformer_layer_config"), dict):
        raise ValueError(f"a speculators config needs speculators_model_type \"eagle3\" (the only kind supported) "
                         f"and a transformer_layer_config dict; got speculators_model_type {kind!r}")
    config = dict(raw["transformer_layer_config"], architectures=["LlamaForCausalLMEagle3"],
                  norm_before_residual=raw.get("norm_before_residual", True))
    config.pop("model_type", None)
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if raw.get(key) is not None:
            config[key] = raw[key]
    return LlamaConfig(**config)


def load_tokenizer(path: str, load_format: str, hf_config: PretrainedConfig | None = None,
                   trust_remote_code: bool = False, tokenizer: str | None = None):
    """The model's tokenizer, or None when it has none (token-id prompts still work); or the
    tokenizer of `tokenizer` (a folder or hub id, vLLM's engine argument; ValueError when
    transformers cannot load one from it); with
    trust_remote_code transformers may run the model folder's own tokenizer code. For a Qwen
    GGUF file the tokenizer class is named (hf_config.model_type): AutoTokenizer would otherwise
    rebuild the config from the file first, a ~15 s parse of its vocabulary on one CPU core that
    read_hf_config has just done (the same tokenizer either way). Other architectures keep
    AutoTokenizer's own choice (e.g. a llama GGUF may need a byte-level tokenizer, not LlamaTokenizer)."""
    kwargs = {}
    if tokenizer is not None:  # the user's, instead of the model's
        try:
            return AutoTokenizer.from_pretrained(os.fspath(tokenizer), trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ValueError(f"tokenizer={tokenizer!r} is not a tokenizer folder or hub id "
                             f"transformers can load: {e}") from None
    if load_format == "gguf":
        path, kwargs["gguf_file"] = os.path.split(path)
        if hf_config is not None and hf_config.model_type in ("qwen2", "qwen3"):
            kwargs["tokenizer_type"] = hf_config.model_type
    elif not os.path.isdir(path) or not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError):
        return None


# generation_config.json's name -> SamplingParams' (vLLM's ModelConfig.get_diff_sampling_param)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(path: str, load_format: str) -> dict:
    """The fields the model's generation_config.json sets (transformers' GenerationConfig, as a
    diff dict); {} when there is none (GGUF files, builtin configs). ValueError when it cannot be
    read."""
    if load_format == "gguf" or not os.path.isfile(os.path.join(path, "generation_config.json")):
        return {}
    try:
        return GenerationConfig.from_pretrained(path).to_diff_dict()
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}/generation_config.json: {e}") from None


def generation_defaults(generation_config: dict) -> dict:
    """The SamplingParams defaults a generation config sets (of those GENERATION_DEFAULTS maps;
    max_new_tokens becomes max_tokens), as vLLM's generation_config="auto"."""
    return {name: generation_config[k] for k, name in GENERATION_DEFAULTS.items()
            if generation_config.get(k) is not None}


def iter_weights(path: str, load_format: str, hf_config: PretrainedConfig):
    """(Hugging Face name, tensor) pairs of the checkpoint at `path` ("safetensors" or "gguf";
    a GGUF's tensor names come from transformers' mapping for `hf_config`). Float8 weights of an
    fp8 checkpoint come out dequantized to float32, without their scale tensors. Raises ValueError
    naming an unreadable file or a float8 tensor without a scale."""
    if load_format == "gguf":
        yield from _iter_gguf(path, hf_config)
        return
    files = safetensors_files(path)
    quantization = getattr(hf_config, "quantization_config", None) or {}
    block = quantization.get("weight_block_size") if isinstance(quantization, dict) else \
        getattr(quantization, "weight_block_size", None)
    where = {}  # tensor name -> its file, for the scales of float8 weights
    for file in files:
        try:
            with safe_open(file, "pt", "cpu") as f:
                where.update(dict.fromkeys(f.keys(), file))
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"cannot read weights file {file}: {e}") from None
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                if name.endswith(FP8_SCALES):
                    continue  # read with their weights; activations get scales of their own (nanovllm/kernels/fp8.py)
                tensor = f.get_tensor(name)
                yield name, _dequantized(name, tensor, where, block) if tensor.dtype == torch.float8_e4m3fn else tensor


FP8_SCALES = (".weight_scale_inv", ".weight_scale", ".input_scale")  # the tensors of fp8 checkpoints beside weights


def _dequantized(name: str, weight: torch.Tensor, where: dict, block: list | None) -> torch.Tensor:
    """A float8 checkpoint weight in float32: times its `weight_scale_inv` (per block of
    quantization_config.weight_block_size: Qwen's and DeepSeek's fp8 format) or `weight_scale`
    (per tensor or per output channel). ValueError when it has neither, or block scales and no
    block size."""
    base = name.removesuffix(".weight")
    for suffix in ("weight_scale_inv", "weight_scale"):
        if f"{base}.{suffix}" in where:
            with safe_open(where[f"{base}.{suffix}"], "pt", "cpu") as f:
                scale = f.get_tensor(f"{base}.{suffix}").float()
            if scale.dim() == 2 and scale.size(1) > 1:
                if not block:
                    raise ValueError(f"checkpoint tensor {name!r} has block scales, but quantization_config has "
                                     f"no weight_block_size")
                try:
                    return dequantize_blocks(weight, scale, tuple(block))
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
            return weight.float() * scale.reshape(-1, 1)
    raise ValueError(f"checkpoint tensor {name!r} is float8 but has no {base}.weight_scale_inv or .weight_scale")


def _iter_gguf(file: str, hf_config):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    with torch.device("meta"):  # only the module names are needed to map GGUF tensors
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    yield from load_gguf_checkpoint(file, return_tensors=True, model_to_load=skeleton)["tensors"].items()


def safetensors_files(path: str) -> list[str]:
    """The checkpoint's *.safetensors files (per its index, when it has one); FileNotFoundError when
    there are none or the index names a missing shard."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        for name in files:
            if not os.path.isfile(os.path.join(path, name)):
                raise FileNotFoundError(f"{index} names shard {name!r}, which is not in {path}")
        return [os.path.join(path, name) for name in files]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (use load_format='dummy' for random weights)")
    return files


def _download(repo_id: str) -> str:
    looks_like_hub_id = repo_id.count("/") == 1 and not repo_id.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise FileNotFoundError(f"model path {repo_id!r} does not exist")
    from huggingface_hub import snapshot_download
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
    try:
        return snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as e:
        raise FileNotFoundError(f"{repo_id!r} is not a local path and could not be downloaded from the "
                                f"Hugging Face hub ({type(e).__name__}: {e}); pass a local directory instead") from None
