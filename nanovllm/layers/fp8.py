"""Float8 e4m3 (OCP FP8 spec, 2023): the quantizer the KV cache and the linear layers share, and
the FP8 linear layer's math (quantization="fp8", vLLM's name).

Weights get one scale per output channel, activations (where quantized) one per token, both
computed from the data (max|x| / 448), so nothing needs calibration. A checkpoint quantized in
128 x 128 blocks (Qwen3-*-FP8, `weight_scale_inv`) is dequantized at load (dequantize_blocks) and
quantized again per channel: one GEMM shape for every checkpoint; on the GPU a Triton kernel
with bf16 activations for small batches and torch._scaled_mm with row-wise scales (cuBLASLt) for
large ones, elsewhere the W8A8 math on dequantized float32 values.
"""
import torch

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


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b with W stored as float8: x [..., in] (the model dtype), weight [out, in]
    float8 e4m3, weight_scale [out] float32 (W = weight * weight_scale per row). Up to
    MAX_W8A16_ROWS rows of bf16/fp16 on CUDA (decode steps, which read their weights and little
    else), x stays as it is and the float8 weights are widened in registers
    (fp8_kernel.fp8_weight_gemm). Otherwise x is quantized per token (quantize_fp8; on CUDA its
    one-kernel twin fp8_kernel.quantize_rows), so y = (q_x q_W^T) * s_x s_W^T: on CUDA one
    torch._scaled_mm (in, out multiples of 16; compute capability 8.9+, checked by the config),
    twice bf16's tensor-core rate for prefill; elsewhere the same quantized values multiplied in
    float32. Returns [..., out] in x's dtype."""
    shape = x.shape
    if x.is_cuda and x.numel() <= MAX_W8A16_ROWS * shape[-1] and x.dtype != torch.float32:
        from nanovllm.layers.fp8_kernel import fp8_weight_gemm
        y = fp8_weight_gemm(x.reshape(-1, shape[-1]), weight, weight_scale)
    elif x.is_cuda:
        from nanovllm.layers.fp8_kernel import quantize_rows
        qx, sx = quantize_rows(x.reshape(-1, shape[-1]))
        # row-wise scales need a bf16 output (cuBLASLt); a float16 model converts it
        y = torch._scaled_mm(qx, weight.t(), scale_a=sx.unsqueeze(1), scale_b=weight_scale.unsqueeze(0),
                             out_dtype=torch.bfloat16).to(x.dtype)
    else:
        qx, sx = quantize_fp8(x.reshape(-1, shape[-1]))
        y = ((qx.float() @ weight.float().t()) * sx.unsqueeze(1) * weight_scale).to(x.dtype)  # scales factor out
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], -1)

