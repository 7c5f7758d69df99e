"""Float8 e4m3 (OCP FP8 spec, 2023): the quantizer the KV cache and the linear layers share, and
the FP8 linear layer's math (quantization="fp8", vLLM's name).

Weights get one scale per output channel, activations (where quantized) one per token, both
computed from the data (max|x| / 448), so nothing needs calibration. A checkpoint quantized in
128 x 128 blocks (Qwen3-*-FP8, `weight_scale_inv`) is dequantized at load (dequantize_blocks) and
quantized again per channel: one GEMM shape for every checkpoint; on the GPU a Triton kernel
with bf16 activations for small batches and torch._scaled_mm with row-wise scales (cuBLASLt) for
large ones (its input quantized by the RMSNorm before it where there is one: rms_norm_fp8),
elsewhere the W8A8 math on dequantized float32 values.
"""
import torch

from nanovllm.kernels.activation import swiglu
from nanovllm.kernels.rms_norm import rms_norm
from nanovllm.kernels.compile import token_compile

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448, the largest finite e4m3 value
MAX_W8A16_ROWS = 16  # up to this many tokens fp8_linear keeps activations in the model dtype (fp8_gemm.py)


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., n] -> (x / scale as float8 `dtype` [..., n], scale [...] float32), one scale per
    vector along the last dim: scale = max|x| * (1 / 448) (at least 1e-30 / 448, so zeros stay 0;
    a product, as torch on CUDA computes a division by a number, so Triton kernels can match it)."""
    xf = x.float()
    scale = xf.abs().amax(-1).clamp_min(1e-30) * (1 / FP8_MAX)
    return (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(dtype), scale


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A block-quantized checkpoint weight in float32: weight [out, in] float8, scale_inv
    [ceil(out / b0), ceil(in / b1)] float32, one multiplier per block of block = (b0, b1)
    (quantization_config.weight_block_size, [128, 128] in Qwen's FP8 checkpoints), the last ones
    partial. Raises ValueError when scale_inv does not have that grid's shape."""
    (out, inp), (b0, b1) = weight.shape, block
    if tuple(scale_inv.shape) != (-(-out // b0), -(-inp // b1)):
        raise ValueError(f"a weight of shape {tuple(weight.shape)} in blocks of {b0} x {b1} needs scales of shape "
                         f"{(-(-out // b0), -(-inp // b1))}, got {tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :inp]
    return weight.float() * scale


def quantizes_activations(x: torch.Tensor, weight_scale: torch.Tensor | None) -> bool:
    """Whether fp8_linear quantizes x [num_tokens, in] per token for a weight with weight_scale
    (float8): on CUDA past MAX_W8A16_ROWS rows of bf16/fp16 or at any size of float32, and on CPU."""
    return weight_scale is not None and not (
        x.is_cuda and x.numel() <= MAX_W8A16_ROWS * x.size(-1) and x.dtype != torch.float32)


@token_compile
def rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """rms_norm.rms_norm, then quantize_fp8 of its output, compiled into one kernel on CUDA:
    ((q, scale), r), the input of scaled_mm. A float8 model's norm_linear runs it where the
    product quantizes its input (quantizes_activations), so the normed rows in the model dtype
    are never written and read again, nor quantize_rows launched: 72 of its 144 launches per
    decode step of Qwen3-8B."""
    y, r = rms_norm(x, residual, weight, eps)
    return quantize_fp8(y), r


@token_compile
def swiglu_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """activation.swiglu, then quantize_fp8 of its output, compiled into one kernel on CUDA: the
    gated down_proj's input for scaled_mm. With rms_norm_fp8, 1.24 -> 0.98 ms of norms, gates and
    quantizations per decode step of 256 rows of Qwen3-8B on an H100 (docs/perf-log.md, 2026-11-26)."""
    return quantize_fp8(swiglu(x))


def scaled_mm(qx: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """(qx * sx) (weight * weight_scale)^T + bias in `dtype`: qx [M, in] float8 e4m3 with sx [M]
    float32 per row (quantize_fp8's output), weight [out, in] float8 with weight_scale [out]. On
    CUDA one torch._scaled_mm (in, out multiples of 16; compute capability 8.9+, checked by the
    config), twice bf16's tensor-core rate for prefill; elsewhere the same values multiplied in
    float32 (the scales factor out)."""
    if qx.is_cuda:  # row-wise scales need a bf16 output (cuBLASLt); a float16 model converts it
        y = torch._scaled_mm(qx, weight.t(), scale_a=sx.unsqueeze(1), scale_b=weight_scale.unsqueeze(0),
                             out_dtype=torch.bfloat16).to(dtype)
    else:
        y = ((qx.float() @ weight.float().t()) * sx.unsqueeze(1) * weight_scale).to(dtype)
    return y if bias is None else y + bias


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b with W stored as float8: x [..., in] (the model dtype), weight [out, in]
    float8 e4m3, weight_scale [out] float32 (W = weight * weight_scale per row). Up to
    MAX_W8A16_ROWS rows of bf16/fp16 on CUDA (decode steps, which read their weights and little
    else), x stays as it is and the float8 weights are widened in registers
    (fp8_kernel.fp8_weight_gemm). Otherwise x is quantized per token (quantize_fp8; on CUDA its
    one-kernel twin fp8_kernel.quantize_rows), so y = (q_x q_W^T) * s_x s_W^T (scaled_mm).
    Returns [..., out] in x's dtype."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if not quantizes_activations(x, weight_scale):
        from nanovllm.kernels.fp8_gemm import fp8_weight_gemm
        y = fp8_weight_gemm(x, weight, weight_scale)
        y = y if bias is None else y + bias
    else:
        if x.is_cuda:
            from nanovllm.kernels.fp8_gemm import quantize_rows
            qx, sx = quantize_rows(x)
        else:
            qx, sx = quantize_fp8(x)
        y = scaled_mm(qx, sx, weight, weight_scale, bias, x.dtype)
    return y.view(*shape[:-1], -1)

