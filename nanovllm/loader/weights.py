"""Copies checkpoint tensors (Hugging Face names) into the model's packed, possibly sharded
parameters, and makes the random checkpoint of load_format="dummy"."""
import zlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from nanovllm.distributed.state import TensorParallel


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


def check_weights_fit(model_cls, hf_config, tp: TensorParallel, dtype: torch.dtype, gpu_memory_utilization: float):
    """Raise MemoryError, before allocating anything, when the weights of model_cls on this rank
    (tp) in dtype alone exceed the engine's share of the GPU: gpu_memory_utilization x total memory,
    less what is already in use (after this process's allocator returns its cached free memory,
    e.g. a deleted LLM's)."""
    with torch.device("meta"):
        params = {id(p): p for p in model_cls(hf_config, tp).parameters()}.values()
    need = sum(p.numel() for p in params) * dtype.itemsize
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    share = total * gpu_memory_utilization - (total - free)
    if need > share:
        raise MemoryError(f"the weights need {need / 2**30:.2f} GiB in {dtype}, but the engine may use "
                          f"{max(share, 0) / 2**30:.2f} GiB (gpu_memory_utilization={gpu_memory_utilization} of "
                          f"{total / 2**30:.1f} GiB, {(total - free) / 2**30:.2f} GiB already in use); raise "
                          f"gpu_memory_utilization, pick a smaller dtype, or free the GPU")


def _copy(param: nn.Parameter, tensor: torch.Tensor):
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)


def dummy_weights(model_cls, hf_config, seed: int, device: torch.device,
                  dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """A random checkpoint with the model's Hugging Face tensor names and full (unsharded)
    shapes: N(0, initializer_range) matrices, ones for norm weights, zeros for biases. Each
    tensor is drawn from a generator seeded by `seed` and its name, so every
    tensor_parallel_size loads the same weights."""
    with torch.device("meta"):
        full = model_cls(hf_config, TensorParallel(0, 1))
    unpacked = {}  # packed fragment -> checkpoint fragments in shard order
    for fragment, (packed, _) in full.packed_modules_mapping.items():
        unpacked.setdefault(packed, []).append(fragment)
    std = getattr(hf_config, "initializer_range", 0.02)
    for name, param in full.named_parameters():
        pieces = [(name, param.shape)]
        for packed, fragments in unpacked.items():
            if f".{packed}." in name:
                sizes = full.get_submodule(name.rsplit(".", 1)[0]).output_sizes
                pieces = [(name.replace(f".{packed}.", f".{f}."), (size, *param.shape[1:]))
                          for f, size in zip(fragments, sizes)]
        for piece, shape in pieces:
            if piece.endswith("norm.weight"):
                yield piece, torch.ones(shape, device=device, dtype=dtype)
            elif piece.endswith("bias"):
                yield piece, torch.zeros(shape, device=device, dtype=dtype)
            else:
                generator = torch.Generator(device).manual_seed(seed * 2**32 + zlib.crc32(piece.encode()))
                yield piece, torch.empty(shape, device=device, dtype=dtype).normal_(0.0, std, generator=generator)
