"""Float8 e4m3 in Triton: quantize_fp8's rounding for kernels (the KV store in
qk_norm_rope_kernel.py uses it too), and the per-token quantization of activations for float8
GEMMs (layers/fp8.py fp8_linear) in one kernel, where torch takes eight per linear layer (cast,
abs, max, clamp, scale, divide, clamp, cast), ~900 per decode step of a 28-layer model."""
import torch
import triton
import triton.language as tl


@triton.jit
def _round_to_e4m3(x):
    """x: float32, |x| <= 448, rounded (ties to even) to the float8 e4m3 grid, still in float32, so
    that the cast to float8 after it is exact. A GPU rounds that cast the same way, but Triton's
    CPU interpreter does not carry a rounded-up mantissa into the exponent (1.97 -> 1.0), so the
    kernel rounds first. e4m3 keeps 3 mantissa bits: its step is 2^(max(e, -6) - 3) for |x| in
    [2^e, 2^(e+1)); adding then subtracting c = 1.5 * 2^23 * step rounds x to a multiple of the
    step, as float32's ulp at c is that step."""
    biased_exponent = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF  # e + 127
    c = (((tl.maximum(biased_exponent, 127 - 6) + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (x + c) - c


@triton.jit
def _quantize_e4m3(x, scale):
    """x / scale (float32; an IEEE division, as torch's) clamped to +-448 and rounded to the e4m3
    grid, ready for an exact cast to float8: quantize_fp8's values, for Triton kernels."""
    return _round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0))


@triton.jit
def quantize_rows_kernel(x_ptr, stride, out_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    """Grid (num_rows,): row r of x [num_rows, n] (rows `stride` apart, any float dtype) as float8
    e4m3 x / scale into out [num_rows, n] and scale = max|x| * (1 / 448) into scale [num_rows]
    float32: quantize_fp8's values (a tiny negative value may round to +0 where torch writes -0)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-30) * (1.0 / 448.0)
    tl.store(out_ptr + row * n + offs, _quantize_e4m3(x, scale).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8(x) for x [num_rows, n]: (float8 e4m3 [num_rows, n], scales [num_rows]
    float32), in one kernel (one program per row, the row held in registers)."""
    x = x if x.stride(1) == 1 else x.contiguous()
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n)
    quantize_rows_kernel[(rows,)](x, x.stride(0), out, scale, n, BLOCK=block, num_warps=min(16, max(4, block // 1024)))
    return out, scale
