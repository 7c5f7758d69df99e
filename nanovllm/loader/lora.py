"""PEFT LoRA adapters on disk: checked against the base model before any work, and read.

An adapter is a directory saved by PEFT's save_pretrained: adapter_config.json (r, lora_alpha,
use_rslora, target_modules, ...) and adapter_model.safetensors, whose tensors are named after the
base model's modules, e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
([r, in_features]) and ...lora_B.weight ([out_features, r]). The delta of a module is
scale * x A^T B^T with scale = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora.
"""
import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open

from nanovllm.distributed.state import TensorParallel
from nanovllm.layers.linear import LinearBase
from nanovllm.layers.linear_method import LinearMethod
from nanovllm.lora.request import LoRARequest
from nanovllm.models.registry import model_class

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's prefix of the base model's module names
MATRICES = {"lora_A.weight": 0, "lora_B.weight": 1}


@dataclass(frozen=True)
class LoRATarget:
    """A base-model module an adapter may change: our (packed) layer's name, the index of its
    projection among those packed in it, that projection's weight_loader shard id, and its full
    (unsharded) out_features and in_features."""
    layer: str
    index: int
    shard: object
    out_features: int
    in_features: int


@dataclass(frozen=True)
class AdapterInfo:
    """A checked adapter: its rank, its delta's scale, and the PEFT names of the modules it changes."""
    rank: int
    scale: float
    modules: tuple[str, ...]


def lora_targets(hf_config) -> dict[str, LoRATarget]:
    """PEFT module name (e.g. "model.layers.0.self_attn.q_proj") -> LoRATarget, for every
    projection of the model's linear layers built with the model's method, which adapters wrap (q/k/v
    packed into qkv_proj, gate/up into gate_up_proj); not a mixture of experts' router, which keeps
    a method of its own (models/moe.py), nor its experts."""
    method = LinearMethod()  # the model's: what marks the layers adapters reach
    with torch.device("meta"):
        model = model_class(hf_config)(hf_config, TensorParallel(0, 1), None, method)
    packed: dict[str, list] = {}
    for fragment, (layer, shard) in model.packed_modules_mapping.items():
        packed.setdefault(layer, []).append((fragment, shard))
    targets = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and module.quant_method is method:
            parent, leaf = name.rsplit(".", 1)
            parts = packed.get(leaf, [(leaf, None)])
            sizes = module.output_sizes if leaf in packed else [module.weight.size(0)]
            for index, ((fragment, shard), size) in enumerate(zip(parts, sizes)):
                targets[f"{parent}.{fragment}"] = LoRATarget(name, index, shard, size, module.weight.size(1))
    return targets


MOE_HINT = " (a mixture of experts' router, mlp.gate, and its experts take no adapter)"


def _moe_hint(modules: list[str]) -> str:
    """MOE_HINT where modules name a mixture of experts' router (mlp.gate) or experts, else ""."""
    return MOE_HINT if any(m.rsplit(".", 1)[-1] == "gate" or "experts" in m.split(".") for m in modules) else ""


def check_adapter(request: LoRARequest, targets: dict[str, LoRATarget], max_lora_rank: int) -> AdapterInfo:
    """Read the adapter's config and its tensors' names and shapes (not their values) and check them
    against the base model; ValueError naming the adapter, what is wrong and what is allowed: no
    adapter at lora_path, another PEFT method, DoRA, modules_to_save, a LoRA bias, target_parameters,
    per-module ranks or alphas, r above max_lora_rank, a target module the model has no LoRA layer
    for, a tensor of the wrong shape."""
    path = os.path.expanduser(str(request.lora_path))

    def fail(message):
        return ValueError(f"LoRA adapter {request.lora_name!r} (lora_int_id {request.lora_int_id}, {path}): {message}")
    config_file, weights_file = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isdir(path):
        raise fail("no such directory; lora_path must be a local directory saved by PEFT's save_pretrained")
    if not os.path.isfile(config_file):
        raise fail(f"no {CONFIG_FILE}; lora_path must be a directory saved by PEFT's save_pretrained")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise fail(f"cannot read {CONFIG_FILE}: {e}") from None
    supported = sorted({name.rsplit(".", 1)[1] for name in targets})
    refused = [
        (config.get("peft_type", "LORA") != "LORA", f"a {config.get('peft_type')} adapter; only LoRA is supported"),
        (config.get("use_dora"), "DoRA (use_dora) is not supported"),
        (config.get("modules_to_save"), f"modules_to_save {config.get('modules_to_save')} is not supported (the "
                                        f"adapter carries fully trained copies of those modules, not LoRA weights)"),
        (config.get("bias", "none") != "none", f"bias={config.get('bias')!r} is not supported, only bias='none'"),
        (config.get("fan_in_fan_out"), "fan_in_fan_out is not supported"),
        (config.get("target_parameters"), f"target_parameters {config.get('target_parameters')} (LoRA on parameters, "
                                          f"as PEFT adapts a mixture of experts' router and experts) is not supported"
                                          f"{MOE_HINT}"),
        (config.get("rank_pattern") or config.get("alpha_pattern"),
         "per-module ranks or alphas (rank_pattern, alpha_pattern) are not supported"),
    ]
    for wrong, message in refused:
        if wrong:
            raise fail(message)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1 or not isinstance(alpha, (int, float)):
        raise fail(f"r must be a positive integer and lora_alpha a number, got r={rank!r}, lora_alpha={alpha!r}")
    if rank > max_lora_rank:
        raise fail(f"rank r={rank} is above max_lora_rank={max_lora_rank}; raise the engine argument max_lora_rank")
    wanted = config.get("target_modules") or []
    unknown = sorted({t.rsplit(".", 1)[-1] for t in wanted} - set(supported)) if isinstance(wanted, list) else []
    if unknown:
        raise fail(f"target module(s) {unknown} not supported{_moe_hint(unknown)}; LoRA applies to {supported}")
    if not os.path.isfile(weights_file):
        raise fail(f"no {WEIGHTS_FILE}" + (" (adapter_model.bin is not read: save with safe_serialization)"
                                           if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""))
    try:
        with safe_open(weights_file, framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as e:
        raise fail(f"cannot read {WEIGHTS_FILE}: {e}") from None
    found: dict[str, list] = {}
    for key, shape in shapes.items():
        module, matrix = _split(key)
        target = targets.get(module)
        if target is None:
            raise fail(f"tensor {key} is not a LoRA weight of a module nanovllm adapts{_moe_hint([module])}; LoRA "
                       f"applies to {supported}")
        expected = (rank, target.in_features) if matrix == 0 else (target.out_features, rank)
        if shape != expected:
            raise fail(f"tensor {key} has shape {list(shape)}, expected {list(expected)} (r={rank})")
        found.setdefault(module, [None, None])[matrix] = key
    lonely = [module for module, pair in found.items() if None in pair]
    if lonely or not found:
        raise fail(f"modules {lonely[:4]} lack their lora_A or lora_B" if lonely else "holds no LoRA weights")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterInfo(rank, scale, tuple(sorted(found)))


def _split(key: str) -> tuple[str, int | None]:
    """(PEFT module name, 0 for A, 1 for B, None for neither) of a tensor name."""
    name = key[len(PREFIX):] if key.startswith(PREFIX) else key
    for suffix, matrix in MATRICES.items():
        if name.endswith("." + suffix):
            return name[:-len(suffix) - 1], matrix
    return name, None


def load_adapter(request: LoRARequest, targets: dict[str, LoRATarget],
                 max_lora_rank: int) -> tuple[AdapterInfo, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """check_adapter, then the adapter's tensors: PEFT module name -> (A [r, in_features], B
    [out_features, r]) in float32 on the CPU, B not yet scaled."""
    info = check_adapter(request, targets, max_lora_rank)
    weights: dict[str, list] = {module: [None, None] for module in info.modules}
    with safe_open(os.path.join(os.path.expanduser(str(request.lora_path)), WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            module, matrix = _split(key)
            weights[module][matrix] = f.get_tensor(key).float()
    return info, {module: tuple(pair) for module, pair in weights.items()}
