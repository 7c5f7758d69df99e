"""How a linear layer's product is computed: the one seam every product goes through.

A LinearMethod is chosen when the model is built (linear_method(quantization)) and owns what the
layer's weight is once loaded (process_weights_after_loading) and the products: apply (x W^T + b,
SwiGLU's gate optionally fused in front) and apply_norm (a pre-norm block's first product, the
RMSNorm and residual add fused in front; apply_norm_input also returns the normed input). Each
method picks its kernels by the step's shape: bf16/fp16 on CUDA, one row (a decode step of one
sequence) takes kernels/gemv.py, 2 to SKINNY_MAX_ROWS rows kernels/skinny_gemm.py, more rows cuBLAS.
Quantization, adapters or experts plug in as another method (or a wrapper of one) without touching
the layers or the models.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.activation import silu_and_mul
from nanovllm.kernels.fp8 import fp8_linear, quantize_fp8, quantizes_activations, rms_norm_fp8, scaled_mm, swiglu_fp8
from nanovllm.layers.layernorm import residual_norm

SKINNY_MAX_ROWS = 64  # under 2% gain over cuBLAS from 96 rows on (benchmarks/decode_gemm.py)


def one_row(x: torch.Tensor) -> bool:
    """A decode step of one sequence in bf16/fp16 on CUDA: kernels/gemv.py's kernels take its products."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.numel() == x.size(-1)


def few_rows(x: torch.Tensor) -> bool:
    """A decode step of 2 to SKINNY_MAX_ROWS sequences in bf16/fp16 on a Hopper or newer GPU (the
    tilings assume its shared memory): kernels/skinny_gemm.py's kernels take its products, norms and gate."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2
            and 2 <= x.size(0) <= SKINNY_MAX_ROWS):
        return False
    from nanovllm.kernels.pdl import hopper  # Triton: imported only on CUDA
    return hopper(x.device)


def gate_rows(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate silu(gate) * up of x = [gate | up]: [num_tokens, 2N] -> [num_tokens, N], by the
    kernel the products take at this many rows (skinny_gemm's from 2 to SKINNY_MAX_ROWS)."""
    if few_rows(x):
        from nanovllm.kernels.skinny_gemm import silu_and_mul_rows
        return silu_and_mul_rows(x)
    return silu_and_mul(x)


def norm_rows(x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(r), r) for r = x + residual (layernorm.residual_norm), by the kernel the products take
    at this many rows (skinny_gemm's from 2 to SKINNY_MAX_ROWS)."""
    if few_rows(x):
        from nanovllm.kernels.skinny_gemm import rms_norm_rows
        return rms_norm_rows(x, residual, norm.weight, norm.eps)
    return residual_norm(x, residual, norm)


class LinearMethod:
    """The products of a layer with `weight` [out, in] (and `weight_scale`, `bias` as the method
    keeps them). x: [num_tokens, in] (gated: [num_tokens, 2 * in] = [gate | up], multiplied as
    silu(gate) * up first); results in x's dtype, written to out (contiguous) when given.
    rows_independent: apply may compute any slice of a step's rows alone (a tensor-parallel
    prefill's row-parallel product goes chunk by chunk, TPGroup.send_partial_sums).
    quantization: the Config.quantization it implements (the experts' method follows it: moe_method.py)."""
    rows_independent = True
    quantization: str | None = None
    one_row_gemv = False  # one row's product is gemv.py's of layer.weight (and weight_scale): adapters join its launch

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded model-dtype weight into what apply reads (nothing to do by default)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, gated: bool = False,
              out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def apply_norm(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                   norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer's product of norm(r), r) for r = x + residual (r = x when residual is None);
        x, residual: [num_tokens, hidden_size], norm a layernorm.RMSNorm. Unfused: the norm, then apply."""
        x, residual = norm_rows(x, residual, norm)
        return self.apply(layer, x, layer.bias), residual

    def apply_norm_input(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                         norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """apply_norm's (product, r) and the product's input norm(r) [num_tokens, hidden_size] too, for
        a block whose other products read it (the experts after their router). Unfused: the norm,
        then apply."""
        normed, residual = norm_rows(x, residual, norm)
        return self.apply(layer, normed, layer.bias), residual, normed


class UnquantizedLinearMethod(LinearMethod):
    """Weights in the model dtype."""
    one_row_gemv = True

    def apply(self, layer, x, bias, gated=False, out=None):
        weight = layer.weight
        if one_row(x):  # the gate fused into the GEMV's loads
            from nanovllm.kernels.gemv import gemv
            return gemv(x, weight, None, bias, gated, out=out)
        if gated:
            x = gate_rows(x)
        if few_rows(x):
            from nanovllm.kernels.skinny_gemm import skinny_linear
            return skinny_linear(x, weight, bias, out=out)
        if out is None:
            return F.linear(x, weight, bias)
        torch.matmul(x, weight.t(), out=out)
        return out if bias is None else out.add_(bias)

    def apply_norm(self, layer, x, residual, norm):
        if one_row(x):  # one GEMV kernel, the norm computed while loading x
            from nanovllm.kernels.gemv import norm_gemv
            return norm_gemv(x, residual, norm.weight, norm.eps, layer.weight, None, layer.bias)
        return super().apply_norm(layer, x, residual, norm)

    def apply_norm_input(self, layer, x, residual, norm):
        if one_row(x):  # one GEMV kernel, whose first program writes the normed input as it reads it
            from nanovllm.kernels.gemv import norm_gemv
            normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            y, r = norm_gemv(x, residual, norm.weight, norm.eps, layer.weight, None, layer.bias, normed_out=normed)
            return y, r, normed
        return super().apply_norm_input(layer, x, residual, norm)


class Fp8LinearMethod(LinearMethod):
    """quantization="fp8": the loaded weight kept as float8 e4m3 with one float32 scale per output
    channel (weight_scale [out]); activations quantized per token where the product is large enough
    to gain from float8 matrix cores (kernels/fp8.py: quantizes_activations)."""
    quantization = "fp8"
    one_row_gemv = True

    @torch.no_grad()
    def process_weights_after_loading(self, layer):
        weight, layer.weight_scale = quantize_fp8(layer.weight)
        layer.weight = nn.Parameter(weight, requires_grad=False)

    def apply(self, layer, x, bias, gated=False, out=None):
        weight, scale = layer.weight, layer.weight_scale
        if one_row(x):
            from nanovllm.kernels.gemv import gemv
            return gemv(x, weight, scale, bias, gated, out=out)
        if gated and quantizes_activations(x, scale):  # the gate and the quantization in one compiled kernel
            y = scaled_mm(*swiglu_fp8(x), weight, scale, bias, x.dtype)
        else:
            y = fp8_linear(silu_and_mul(x) if gated else x, weight, scale, bias)
        return y if out is None else out.copy_(y)

    def apply_norm(self, layer, x, residual, norm):
        if one_row(x):
            from nanovllm.kernels.gemv import norm_gemv
            return norm_gemv(x, residual, norm.weight, norm.eps, layer.weight, layer.weight_scale, layer.bias)
        if quantizes_activations(x, layer.weight_scale):  # the norm and the quantization in one compiled kernel
            quantized, residual = rms_norm_fp8(x, residual, norm.weight, norm.eps)
            return scaled_mm(*quantized, layer.weight, layer.weight_scale, layer.bias, x.dtype), residual
        return super().apply_norm(layer, x, residual, norm)


METHODS = {cls.quantization: cls for cls in (UnquantizedLinearMethod, Fp8LinearMethod)}  # Config.quantization -> method


def linear_method(quantization: str | None) -> LinearMethod:
    """The method of every linear layer of a model built with this (resolved) quantization."""
    return METHODS[quantization]()
