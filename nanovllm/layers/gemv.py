"""One-row products y = x W^T + b (a decode step of one sequence) in one Triton kernel for bf16,
fp16 and float8 weights, with SwiGLU's silu(gate) * up optionally computed while loading x.

At one row a product only streams its weights; cuBLAS then picks tensor-core tilings that leave
bandwidth unused. Measured on an H100 (benchmarks/gemv.py; a CUDA graph of 28 layers' products,
us per layer's four): Qwen3-0.6B 27.5 with cuBLAS, 19.6 with this kernel; Qwen3-8B 154.7 and
134.3; Qwen3-8B's float8 weights 105.1 with the tensor-core W8A16 kernel, 86.4 with this one.
Fusing silu * up into down_proj's loads saves one kernel per layer (9.0 -> 5.2 us at 0.6B);
fusing the RMSNorm into qkv/gate_up's loads saved nothing, so it stays a kernel of its own.
"""
import torch
import triton
import triton.language as tl

from nanovllm.layers.pdl import pdl_args, pdl_start


@triton.jit
def gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, N, K, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
                GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N),): y [N] = (w [N, K] @ a) * scale + bias, one program per BLOCK_N rows
    of w streamed along K (contiguous loads, products in float32, summed along K once at the end;
    no tensor cores). a = x [K], or with GATED silu(x[:K]) * x[K:] for x [2K], rounded to x's
    dtype as silu_and_mul rounds it. scale [N] float32 (float8 weights: W = w * scale per row)."""
    pdl_start(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = k + rk < K
        if GATED:
            gate = tl.load(x_ptr + k + rk, mask=k_mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + K + k + rk, mask=k_mask, other=0.0)
            a = ((gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up).to(tl.float32)
        else:
            a = tl.load(x_ptr + k + rk, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=(rn[:, None] < N) & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * a[None, :]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, 1)
    if SCALED:
        y *= tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)


def gemv_config(k: int, weight_dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages), the fastest of a sweep on an H100 (benchmarks/gemv.py
    --sweep): 2048-wide K steps for Qwen3-8B's K >= 4096, 1024 for Qwen3-0.6B's, 2 rows per
    program for 16-bit weights there (more programs), 4 otherwise."""
    if k >= 4096:
        return 4, 2048, 4, 4
    return (2, 1024, 4, 3) if weight_dtype.itemsize == 2 else (4, 1024, 4, 4)


def gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, gated: bool = False,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] with one row (bf16/fp16, CUDA; [..., 2K] = [gate | up] when gated) @ (weight [N, K]
    in x's dtype or float8 e4m3 times weight_scale [N] float32 per row)^T + bias [N] -> [..., N] in
    x's dtype. config: (BLOCK_N, BLOCK_K, num_warps, num_stages), by default gemv_config's."""
    n, k = weight.shape
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config or gemv_config(k, weight.dtype)
    gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight if weight_scale is None else weight_scale, weight if bias is None else bias, y, n, k,
        SCALED=weight_scale is not None, HAS_BIAS=bias is not None, GATED=gated, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, num_stages=stages, **pdl_args(x.device))
    return y
