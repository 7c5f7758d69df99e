"""Float8 e4m3 in Triton: quantize_fp8's rounding for kernels (the KV store in
qk_norm_rope.py uses it too), and the per-token quantization of activations for float8
GEMMs (fp8.py fp8_linear) in one kernel, where torch takes eight per linear layer (cast,
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


@triton.jit
def fp8_weight_gemm_kernel(x_ptr, w_ptr, scale_ptr, y_ptr, M, N, K, stride_xm,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)): y = (x @ w^T) * scale for one [BLOCK_M, BLOCK_N]
    tile, x [M, K] (rows stride_xm apart) in the model dtype, w [N, K] float8 e4m3 widened to x's
    dtype in registers (exact: every e4m3 value is a bf16 and an fp16 value), scale [N] float32,
    accumulated in float32, y [M, N] contiguous in x's dtype. Programs along N come first, so the
    few M tiles of a decode step read each weight tile from HBM once and from L2 after."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=(rm[:, None] < M) & (rk[None, :] + k < K), other=0.0)
        w = tl.load(w_ptrs, mask=(rn[None, :] < N) & (rk[:, None] + k < K), other=0.0)
        acc = tl.dot(x, w.to(x.dtype), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc *= tl.load(scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


GEMM_CONFIG = (32, 512, 4, 3)  # (BLOCK_N, BLOCK_K, warps, stages): the fastest in benchmarks/fp8_gemm.py


def fp8_weight_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (bf16 or fp16) @ (weight [N, K] float8 e4m3 * weight_scale [N] float32 per row)^T
    -> [M, N] in x's dtype: the activations stay in the model dtype, so a decode step, which
    reads its weights and little else, moves one byte per weight and quantizes nothing. BLOCK_M is
    the smallest of 16/32/64 that holds M (linear.linear sends one row to gemv.gemv instead).
    config: (BLOCK_N, BLOCK_K, num_warps, num_stages), by default GEMM_CONFIG."""
    x = x if x.stride(1) == 1 else x.contiguous()
    (m, k), n = x.shape, weight.size(0)
    block_n, block_k, warps, stages = config or GEMM_CONFIG
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    fp8_weight_gemm_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x, weight, weight_scale, y, m, n, k, x.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)
    return y
