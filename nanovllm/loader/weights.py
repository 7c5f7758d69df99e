"""Copies checkpoint tensors (Hugging Face names) into the model's packed (and stacked: experts),
possibly sharded parameters, and makes the random checkpoint of load_format="dummy"."""
import re
import zlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from nanovllm.distributed.state import TensorParallel


# an expert's weight in a checkpoint: <layer>.experts.<e>.<projection>.weight (the model's expert_mapping
# names the projections)
EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.([^.]+)\.weight$")
# transformers 5's in-memory layout, every expert of a layer in one tensor: <layer>.experts.gate_up_proj
# [E, 2I, H] ([gate | up] per expert) and <layer>.experts.down_proj [E, H, I] -> (FusedMoE parameter, shard ids)
STACKED_EXPERTS = {"gate_up_proj": ("w13_weight", (0, 1)), "down_proj": ("w2_weight", (None,))}


def _targets(name: str, tensor: torch.Tensor, model: nn.Module) -> list[tuple[str, object, torch.Tensor]]:
    """(parameter name, shard, tensor) for a checkpoint tensor: renamed by the model's
    checkpoint_renames, an expert's weight to its FusedMoE parameter with shard (shard id, expert)
    (a stacked tensor of all experts: one piece per expert and shard), a packed projection's to its
    packed parameter with its shard id, anything else to its own name with shard None."""
    for old, new in getattr(model, "checkpoint_renames", {}).items():
        name = name.replace(old, new)
    experts = getattr(model, "expert_mapping", {})
    if experts:
        match = EXPERT_WEIGHT.search(name)
        if match and match.group(2) in experts:
            param, shard_id = experts[match.group(2)]
            return [(f"{name[:match.start()]}.experts.{param}", (shard_id, int(match.group(1))), tensor)]
        prefix, _, last = name.rpartition(".experts.")
        if prefix and last in STACKED_EXPERTS:
            param, shard_ids = STACKED_EXPERTS[last]
            return [(f"{prefix}.experts.{param}", (shard_id, expert), piece) for expert in range(tensor.size(0))
                    for shard_id, piece in zip(shard_ids, tensor[expert].chunk(len(shard_ids)))]
    for fragment, (packed, shard_id) in model.packed_modules_mapping.items():
        if f".{fragment}." in name:
            return [(name.replace(f".{fragment}.", f".{packed}."), shard_id, tensor)]
    return [(name, None, tensor)]


def _expected_shards(name: str, param: nn.Parameter, model: nn.Module) -> list:
    """The shards that fill parameter `name` (as _targets names them), in order: of a FusedMoE's
    stacked experts, its own experts' (expert parallelism: from its first_expert on)."""
    experts = [shard_id for packed, shard_id in getattr(model, "expert_mapping", {}).values()
               if name.endswith(f".experts.{packed}")]
    if experts:
        first = model.get_submodule(name.rpartition(".")[0]).first_expert
        return [(shard_id, expert) for expert in range(first, first + param.size(0)) for shard_id in experts]
    return [shard for packed, shard in model.packed_modules_mapping.values() if f".{packed}." in name] or [None]


def _describe(name: str, shard, model: nn.Module) -> str:
    if isinstance(shard, tuple):  # an expert's projection, named as in the checkpoint
        fragment = next(f for f, (p, s) in model.expert_mapping.items() if name.endswith(p) and s == shard[0])
        return f"{name} (expert {shard[1]}'s {fragment})"
    return name + (f" (shard {shard})" if shard is not None else "")


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]):
    """Load (name, tensor) pairs into `model`, mapping q/k/v_proj onto qkv_proj and gate/up_proj
    onto gate_up_proj through `model.packed_modules_mapping`, and experts' weights (one tensor per
    expert and projection, or transformers 5's stacked tensors) onto the stacked FusedMoE
    parameters through `model.expert_mapping` (see _targets).

    Raises ValueError naming the tensor when its shape does not match, and naming every
    parameter (or expert's projection) that no checkpoint tensor filled.
    """
    params = dict(model.named_parameters())
    loaded: set[tuple[str, object]] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and model.tie_word_embeddings):
            continue
        for target, shard, piece in _targets(name, tensor, model):
            param = params.get(target)
            if param is None:
                continue  # tensors the model does not use (e.g. extra heads); missing ones are caught below
            try:
                if shard is None:
                    param.weight_loader(param, piece) if hasattr(param, "weight_loader") else _copy(param, piece)
                else:
                    param.weight_loader(param, piece, shard)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
            loaded.add((target, shard))
    missing = [_describe(p, s, model) for p, param in params.items() for s in _expected_shards(p, param, model)
               if (p, s) not in loaded]
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
    unpacked, experts = {}, {}  # packed fragment / FusedMoE parameter -> checkpoint fragments in shard order
    for fragment, (packed, _) in full.packed_modules_mapping.items():
        unpacked.setdefault(packed, []).append(fragment)
    for fragment, (param, _) in getattr(full, "expert_mapping", {}).items():
        experts.setdefault(param, []).append(fragment)
    std = getattr(hf_config, "initializer_range", 0.02)
    for name, param in full.named_parameters():
        pieces = [(name, param.shape)]
        for packed, fragments in unpacked.items():
            if f".{packed}." in name:
                sizes = full.get_submodule(name.rsplit(".", 1)[0]).output_sizes
                pieces = [(name.replace(f".{packed}.", f".{f}."), (size, *param.shape[1:]))
                          for f, size in zip(fragments, sizes)]
        prefix, _, last = name.rpartition(".experts.")
        if prefix and last in experts:  # [E, n * rows, cols]: n projections [rows, cols] per expert
            fragments = experts[last]
            shape = (param.size(1) // len(fragments), param.size(2))
            pieces = [(f"{prefix}.experts.{e}.{f}.weight", shape) for e in range(param.size(0)) for f in fragments]
        for piece, shape in pieces:
            if not param.dtype.is_floating_point:  # an index map (an EAGLE-3 head's d2t): the identity
                yield piece, torch.zeros(shape, device=device, dtype=param.dtype)
            elif piece.endswith("norm.weight"):
                yield piece, torch.ones(shape, device=device, dtype=dtype)
            elif piece.endswith("bias"):
                yield piece, torch.zeros(shape, device=device, dtype=dtype)
            else:
                generator = torch.Generator(device).manual_seed(seed * 2**32 + zlib.crc32(piece.encode()))
                yield piece, torch.empty(shape, device=device, dtype=dtype).normal_(0.0, std, generator=generator)
