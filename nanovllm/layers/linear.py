"""Linear layers whose weights are sharded across tensor-parallel ranks (Megatron-LM layout).

Column-parallel layers split the output features, row-parallel layers split the input
features and all-reduce their partial sums. With one rank they are plain linear layers; each
takes the rank's `tp` (TensorParallel: rank and size) at construction. Each parameter carries a
`weight_loader(param, loaded, shard_id)` that copies this rank's slice of a checkpoint tensor
into it, so packed projections (q/k/v into one QKV, gate/up into one) are filled from separate
checkpoint tensors and no rank ever holds more than its shard.
"""
from functools import partial

import torch
from torch import nn

from nanovllm.layers.layernorm import RMSNorm, residual_norm
from nanovllm.layers.linear_method import LinearMethod, UnquantizedLinearMethod
from nanovllm.distributed.state import TensorParallel


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                layer: "ColumnParallelLinear") -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's first product: (layer(norm(r)), r) for r = x + residual, or r = x when
    residual is None; x, residual: [num_tokens, hidden_size]. With tensor parallelism x is this
    rank's partial sums (RowParallelLinear's or the embedding's), summed over the ranks with the
    add and the norm (all_reduce_rms_norm), then the layer's product; otherwise the layer's method
    fuses the norm into its product where it has kernels for that (LinearMethod.apply_norm)."""
    if layer.tp_size > 1:
        x, residual = residual_norm(x, residual, norm, layer.group)
        return layer(x), residual
    return layer.quant_method.apply_norm(layer, x, residual, norm)


def norm_linear_input(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                      layer: "LinearBase") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm_linear's (layer(norm(r)), r) and norm(r) itself, for a block whose other products read
    it too: a mixture of experts' router, then its experts. One launch for a row on CUDA
    (UnquantizedLinearMethod.apply_norm_input)."""
    if layer.tp_size > 1:
        normed, residual = residual_norm(x, residual, norm, layer.group)
        return layer(normed), residual, normed
    return layer.quant_method.apply_norm_input(layer, x, residual, norm)


class LinearBase(nn.Module):
    """y = x W^T + b with W: [output_size, input_size]; `tp_dim` is the dim that is sharded (None:
    replicated). quant_method computes the products and decides what W is once loaded
    (linear_method.py; Fp8LinearMethod: float8 with weight_scale [output_size])."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None, tp: TensorParallel,
                 quant_method: LinearMethod | None = None):
        super().__init__()
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.tp_rank, self.tp_size, self.group = tp.rank, tp.size, tp.group
        self.tp_dim = tp_dim
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        self.register_buffer("weight_scale", None)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
        if self.tp_dim is not None and param.dim() > self.tp_dim and self.tp_size > 1:
            size = param.size(self.tp_dim)
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * size, size)
        _copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


def process_weights_after_loading(model: nn.Module):
    """Let every layer with a method (linear layers, experts: moe_method.py) turn its loaded weights
    into what it computes with (quantization="fp8": float8; embeddings, LM head and norms stay in
    the model dtype)."""
    for module in model.modules():
        if getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(module)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor):
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


class ReplicatedLinear(LinearBase):
    """A layer every rank holds whole (a mixture-of-experts router), computing the full product."""

    def __init__(self, input_size: int, output_size: int, tp: TensorParallel, bias: bool = False,
                 quant_method: LinearMethod | None = None):
        super().__init__(input_size, output_size, bias, None, tp, quant_method)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, tp: TensorParallel, bias: bool = False,
                 quant_method: LinearMethod | None = None):
        super().__init__(input_size, output_size // tp.size, bias, 0, tp, quant_method)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input packed along the output dim (gate_up_proj);
    output_sizes are the full (unsharded) sizes, in shard-id order."""

    def __init__(self, input_size: int, output_sizes: list[int], tp: TensorParallel, bias: bool = False,
                 quant_method: LinearMethod | None = None):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), tp, bias, quant_method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int):
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        loaded = loaded.chunk(self.tp_size, 0)[self.tp_rank]
        _copy_checked(param.data.narrow(0, offset, size), loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections packed as [q | k | v] along the output dim; KV heads are
    replicated when there are fewer of them than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, tp: TensorParallel,
                 bias: bool = False, quant_method: LinearMethod | None = None):
        tp_size = tp.size
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        self.output_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]  # full q, k, v
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, tp, bias, quant_method)  # this rank's heads only

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        loaded = loaded.narrow(0, rank * size, size) if self.tp_size > 1 else loaded
        _copy_checked(param.data.narrow(0, offset, size), loaded)


class RowParallelLinear(LinearBase):
    """Shards the input features. With tp_size > 1, forward returns this rank's partial sums
    [num_tokens, output_size] (bias added on rank 0), which the next norm sums over the ranks
    (all_reduce_rms_norm): written into buffer `slot` where partial_sums_buffer has one,
    else sent to the peer as they are computed where send_partial_sums can. gated: the input is
    [gate | up] (each this rank's shard) and the layer multiplies silu(gate) * up (SwiGLU's
    down_proj)."""

    def __init__(self, input_size: int, output_size: int, tp: TensorParallel, slot: int, bias: bool = False,
                 gated: bool = False, quant_method: LinearMethod | None = None):
        super().__init__(input_size // tp.size, output_size, bias, 1, tp, quant_method)
        self.slot, self.gated = slot, gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = partial(self.quant_method.apply, self, bias=self.bias if self.tp_rank == 0 else None,
                          gated=self.gated)
        if self.tp_size == 1:
            return product(x)
        out = self.group.partial_sums_buffer(x.size(0), x.dtype, self.slot)
        if out is not None:
            return product(x, out=out)
        if not self.quant_method.rows_independent:
            return product(x)  # summed by torch.distributed's all_reduce
        return self.group.send_partial_sums(x, self.weight.size(0), product)
