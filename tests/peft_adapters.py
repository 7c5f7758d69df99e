"""PEFT LoRA adapters of the tiny random Qwen3 (tests/conftest.py), made by peft itself with
init_lora_weights=False (random A and B, so every adapter changes the tokens), and the reference
completions of transformers + peft."""
import copy

import torch

from tests.conftest import hf_greedy, make_tiny_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig arguments: different ranks, target sets, scalings
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], use_rslora=True),
    "all": dict(r=16, lora_alpha=8, target_modules=ALL),
}
_CACHE = {}


def make_adapter(base_model, path, seed: int, **lora_args):
    """Save a PEFT adapter of `base_model` (a transformers model, left unchanged) to `path`;
    returns the PeftModel, in eval mode."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base_model), LoraConfig(init_lora_weights=False, **lora_args)).eval()
    model.save_pretrained(path)
    return model


def tiny_adapters(tmp_path_factory) -> tuple[str, object, dict[str, tuple[str, object]]]:
    """(base model directory, transformers model, name -> (adapter directory, PeftModel)) for ADAPTERS."""
    if "adapters" not in _CACHE:
        path, model = make_tiny_model("qwen3", tmp_path_factory)
        root = tmp_path_factory.mktemp("adapters")
        adapters = {name: (str(root / name), make_adapter(model, root / name, seed, **args))
                    for seed, (name, args) in enumerate(ADAPTERS.items())}
        _CACHE["adapters"] = path, model, adapters
    return _CACHE["adapters"]


def peft_greedy(model, prompts, max_new_tokens) -> list[list[int]]:
    """transformers + peft's greedy completions, EOS ignored."""
    return [hf_greedy(model, p, max_new_tokens) for p in prompts]
