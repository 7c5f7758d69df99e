"""Turns the user's `model` argument into a config, a tokenizer and a stream of checkpoint tensors.

Accepted: a local Hugging Face directory (config.json, *.safetensors, tokenizer files), a hub id
(downloaded with huggingface_hub), a `.gguf` file, or, with load_format="dummy", the name of a
config shipped with the package (e.g. "Qwen/Qwen3-0.6B") for random weights.
"""
import glob
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from nanovllm.models.registry import model_class

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
CONFIG_DIR = Path(__file__).resolve().parent.parent / "models" / "configs"
BUILTIN_CONFIGS = {p.stem: p for p in CONFIG_DIR.glob("*.json")}


@dataclass
class ModelSource:
    hf_config: PretrainedConfig
    tokenizer: object | None
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None  # None: random ("dummy") weights


def _builtin_name(model: str) -> str | None:
    name = model.split("/")[-1].lower()
    return name if name in BUILTIN_CONFIGS else None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(path: str, **kwargs):
    if "gguf_file" not in kwargs and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError):
        return None  # no tokenizer: token-id prompts still work


def _safetensors_files(path: str) -> list[str]:
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


def _iter_safetensors(files: list[str]):
    from safetensors import safe_open
    for file in files:
        try:
            with safe_open(file, "pt", "cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"cannot read weights file {file}: {e}") from None


def _gguf_source(file: str, tokenizer: bool) -> ModelSource:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    folder, name = os.path.split(os.path.abspath(file))
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as e:
        raise ValueError(f"cannot read GGUF file {file}: {e}") from None
    model_class(config)

    def weights():
        with torch.device("meta"):  # only the module names are needed to map GGUF tensors
            skeleton = AutoModelForCausalLM.from_config(config)
        yield from load_gguf_checkpoint(file, return_tensors=True, model_to_load=skeleton)["tensors"].items()

    return ModelSource(config, _load_tokenizer(folder, gguf_file=name) if tokenizer else None, weights)


def resolve_model(model: str, load_format: str = "auto", tokenizer: bool = True) -> ModelSource:
    """Resolve `model` (see the module docstring); tokenizer=False skips loading the tokenizer
    (tensor-parallel workers need none). Raises FileNotFoundError for a missing path or
    weights, ValueError for an unknown load_format or an unreadable config."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a path, a hub id or a builtin config name, got {type(model).__name__}")
    model = os.path.expanduser(str(model))
    if load_format == "dummy" and not os.path.exists(model):
        builtin = _builtin_name(model)
        if builtin is None:
            raise FileNotFoundError(f"{model!r} is neither a directory nor a builtin config; builtin configs for "
                                    f"load_format='dummy': {', '.join(sorted(BUILTIN_CONFIGS))}")
        return ModelSource(AutoConfig.from_pretrained(str(BUILTIN_CONFIGS[builtin])), None, None)
    if os.path.isfile(model) and (model.endswith(".gguf") or load_format == "gguf"):
        return _gguf_source(model, tokenizer)
    if not os.path.exists(model):
        model = _download(model)
    if not os.path.isdir(model):
        raise ValueError(f"{model} is a file but not a .gguf model; pass a model directory or a .gguf file")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise FileNotFoundError(f"{model} has no config.json; it is not a Hugging Face model directory")
    try:
        config = AutoConfig.from_pretrained(model)
    except Exception as e:
        raise ValueError(f"cannot read {os.path.join(model, 'config.json')}: {e}") from None
    model_class(config)  # an unsupported architecture fails before weights are looked for
    tok = _load_tokenizer(model) if tokenizer else None
    if load_format == "dummy":
        return ModelSource(config, tok, None)
    files = _safetensors_files(model)
    return ModelSource(config, tok, lambda: _iter_safetensors(files))


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
