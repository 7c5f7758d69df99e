"""Copies checkpoint tensors (Hugging Face names) into the model's packed, possibly sharded parameters."""
from collections.abc import Iterable

import torch
from torch import nn


def _expected_shards(name: str, packed_modules_mapping: dict) -> set:
    shards = {shard for packed, shard in packed_modules_mapping.values() if f".{packed}." in name}
    return shards or {None}


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]):
    """Load (name, tensor) pairs into `model`, mapping q/k/v_proj onto qkv_proj and gate/up_proj
    onto gate_up_proj through `model.packed_modules_mapping`.

    Raises ValueError naming the tensor when its shape does not match, and naming every
    parameter that no checkpoint tensor filled.
    """
    mapping = model.packed_modules_mapping
    params = dict(model.named_parameters())
    loaded: set[tuple[str, object]] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and model.tie_word_embeddings):
            continue
        target, shard = name, None
        for fragment, (packed, shard_id) in mapping.items():
            if f".{fragment}." in name:
                target, shard = name.replace(f".{fragment}.", f".{packed}."), shard_id
                break
        param = params.get(target)
        if param is None:
            continue  # tensors the model does not use (e.g. extra heads); missing ones are caught below
        try:
            if shard is None:
                param.weight_loader(param, tensor) if hasattr(param, "weight_loader") else _copy(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        loaded.add((target, shard))
    missing = [f"{p}" + (f" (shard {s})" if s is not None else "")
               for p in params for s in _expected_shards(p, mapping) if (p, s) not in loaded]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))


def _copy(param: nn.Parameter, tensor: torch.Tensor):
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)
