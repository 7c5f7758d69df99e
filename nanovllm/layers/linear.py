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
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.activation import silu_and_mul
from nanovllm.kernels.fp8 import fp8_linear, quantize_fp8, quantizes_activations, rms_norm_fp8, scaled_mm, swiglu_fp8
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.distributed.process_group import all_reduce_rms_norm, partial_sums_buffer, send_partial_sums
from nanovllm.distributed.state import TensorParallel


def one_row(x: torch.Tensor) -> bool:
    """A decode step of one sequence in bf16/fp16 on CUDA: gemv.py's kernels take its products."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.numel() == x.size(-1)


SKINNY_MAX_ROWS = 64  # under 2% gain over cuBLAS from 96 rows on (skinny_gemm.py)


def few_rows(x: torch.Tensor, weight_scale: torch.Tensor | None) -> bool:
    """A decode step of 2 to SKINNY_MAX_ROWS sequences in bf16/fp16 on a Hopper or newer GPU (the
    tilings assume its shared memory) with weights in x's dtype: skinny_gemm.py's kernels take its
    products, norms and gate."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight_scale is None
            and x.dim() == 2 and 2 <= x.size(0) <= SKINNY_MAX_ROWS):
        return False
    from nanovllm.kernels.pdl import hopper  # Triton: imported only on CUDA
    return hopper(x.device)


def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, bias: torch.Tensor | None,
           gated: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = a W^T + b for x [..., in] (gated: x = [gate | up] [..., 2 * in] and a = silu(gate) * up,
    else a = x), weight [out, in] in x's dtype or float8 with weight_scale [out] -> [..., out],
    written to out (contiguous, x's shape but the last dim) when given.
    bf16/fp16 on CUDA: one row (a decode step of one sequence) gemv.gemv, the gate fused into its
    loads; a few rows skinny_gemm.py's gate and product kernels; otherwise F.linear, or
    fp8_linear for a float8 weight (gated, where it quantizes x: the gate and the quantization in
    one compiled kernel, swiglu_fp8)."""
    if one_row(x):
        from nanovllm.kernels.gemv import gemv
        return gemv(x, weight, weight_scale, bias, gated, out=out)
    if few_rows(x, weight_scale):
        from nanovllm.kernels.skinny_gemm import silu_and_mul_rows, skinny_linear
        return skinny_linear(silu_and_mul_rows(x) if gated else x, weight, bias, out=out)
    if gated and quantizes_activations(x, weight_scale):
        y = scaled_mm(*swiglu_fp8(x), weight, weight_scale, bias, x.dtype)
        return y if out is None else out.copy_(y)
    if gated:
        x = silu_and_mul(x)
    if weight_scale is not None:
        y = fp8_linear(x, weight, weight_scale, bias)
        return y if out is None else out.copy_(y)
    if out is None:
        return F.linear(x, weight, bias)
    torch.matmul(x, weight.t(), out=out)
    return out if bias is None else out.add_(bias)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                layer: "ColumnParallelLinear") -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's first product: (layer(norm(r)), r) for r = x + residual, or r = x when
    residual is None; x, residual: [num_tokens, hidden_size]. With tensor parallelism x is this
    rank's partial sums (RowParallelLinear's or the embedding's), summed over the ranks with the
    add and the norm (all_reduce_rms_norm). bf16/fp16 on CUDA: one row, one GEMV kernel, the norm
    computed while loading x; a few rows (see linear), skinny_gemm.py's norm and product kernels;
    float8 weights that quantize x (fp8.quantizes_activations), the norm and the quantization in
    one compiled kernel (rms_norm_fp8), then scaled_mm; otherwise RMSNorm, then the layer."""
    if layer.tp_size > 1:
        x, residual = all_reduce_rms_norm(x, residual, norm)
        return layer(x), residual
    if one_row(x):
        from nanovllm.kernels.gemv import norm_gemv
        return norm_gemv(x, residual, norm.weight, norm.eps, layer.weight, layer.weight_scale, layer.bias)
    if few_rows(x, layer.weight_scale):
        from nanovllm.kernels.skinny_gemm import rms_norm_rows, skinny_linear
        x, residual = rms_norm_rows(x, residual, norm.weight, norm.eps)
        return skinny_linear(x, layer.weight, layer.bias), residual
    if quantizes_activations(x, layer.weight_scale):
        quantized, residual = rms_norm_fp8(x, residual, norm.weight, norm.eps)
        return scaled_mm(*quantized, layer.weight, layer.weight_scale, layer.bias, x.dtype), residual
    x, residual = (norm(x), x) if residual is None else norm(x, residual)
    return layer(x), residual


class LinearBase(nn.Module):
    """y = x W^T + b with W: [output_size, input_size]; `tp_dim` is the dim that is sharded (None:
    replicated). After quantize_weight (quantization="fp8"), W is float8 with weight_scale [output_size]."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None, tp: TensorParallel):
        super().__init__()
        self.tp_rank, self.tp_size = tp.rank, tp.size
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
        return linear(x, self.weight, self.weight_scale, self.bias)

    @torch.no_grad()
    def quantize_weight(self):
        """Keep the loaded weight as float8 e4m3 with one scale per output channel (layers/fp8.py)."""
        weight, self.weight_scale = quantize_fp8(self.weight)
        self.weight = nn.Parameter(weight, requires_grad=False)


def quantize_weights(model: nn.Module):
    """quantization="fp8": every linear layer's weight to float8 (embeddings, LM head and norms
    stay in the model dtype)."""
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.quantize_weight()


def _copy_checked(dst: torch.Tensor, src: torch.Tensor):
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, tp: TensorParallel, bias: bool = False):
        super().__init__(input_size, output_size // tp.size, bias, 0, tp)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input packed along the output dim (gate_up_proj);
    output_sizes are the full (unsharded) sizes, in shard-id order."""

    def __init__(self, input_size: int, output_sizes: list[int], tp: TensorParallel, bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), tp, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int):
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        loaded = loaded.chunk(self.tp_size, 0)[self.tp_rank]
        _copy_checked(param.data.narrow(0, offset, size), loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections packed as [q | k | v] along the output dim; KV heads are
    replicated when there are fewer of them than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, tp: TensorParallel,
                 bias: bool = False):
        tp_size = tp.size
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        self.output_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]  # full q, k, v
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, tp, bias)  # this rank's heads only

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        loaded = loaded.narrow(0, rank * size, size) if self.tp_size > 1 else loaded
        _copy_checked(param.data.narrow(0, offset, size), loaded)


class RowParallelLinear(LinearBase):
    """Shards the input features. With tp_size > 1, forward returns this rank's partial sums
    [num_tokens, output_size] (bias added on rank 0), which the next norm sums over the ranks
    (all_reduce_rms_norm): written into symmetric buffer `slot` where partial_sums_buffer has one,
    else sent to the peer as they are computed where send_partial_sums can. gated: the input is
    [gate | up] (each this rank's shard) and the layer multiplies silu(gate) * up (SwiGLU's
    down_proj; see linear)."""

    def __init__(self, input_size: int, output_size: int, tp: TensorParallel, slot: int, bias: bool = False,
                 gated: bool = False):
        super().__init__(input_size // tp.size, output_size, bias, 1, tp)
        self.slot, self.gated = slot, gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = partial(linear, weight=self.weight, weight_scale=self.weight_scale,
                          bias=self.bias if self.tp_rank == 0 else None, gated=self.gated)
        if self.tp_size == 1:
            return product(x)
        out = partial_sums_buffer(x.size(0), x.dtype, self.slot)
        return product(x, out=out) if out is not None else send_partial_sums(x, self.weight.size(0), product)
