"""A decode step's products at a few rows, y = x W^T + b for x [M, K] with 2 <= M <= 64 (decode
steps of a few sequences), and the RMSNorm and SwiGLU gate between them, as one chain of
Triton kernels launched with PDL (layers/pdl.py).

cuBLAS gives such products few, wide output tiles (an N = 1024 product runs on a handful of SMs,
each streaming a large share of the weights) and its kernels do not let the next kernel launch
early: 5.6-7.7 us per product at Qwen3-0.6B's shapes where the weights need 1.3-3.8 us at the
H100's bandwidth. Here each program takes 16-64 weight rows on the tensor cores (the MMA's wide
side, "swap AB": y^T = W x^T, the few rows of x its narrow side), and products with few output
tiles also split K, so that 128-384 programs stream the weights. The split's partial sums are
added by the last program of each tile to finish (a counter per tile; in a fixed order, so
results do not depend on timing). Every kernel here lets the next one launch at once, and a
product loads its first weight tile before waiting for the previous kernel; that overlap is
most of the gain, which is why the norm and the gate between the products are kernels of this
chain too rather than the compiled torch ones. Measured on an H100 (benchmarks/decode_gemm.py, a
layer's chain as the model runs it, us per layer, cuBLAS -> here): 30.8 -> 20.9 at M = 2, 31.5 ->
22.6 at 16, 32.3 -> 28.8 at 32, 33.1 -> 28.7 at 48; from 96 rows on under 2% (34.0 -> 33.4 at 96),
so cuBLAS takes more than 64 (docs/perf-log.md, 2026-11-25, 2026-11-26).
"""
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanovllm.kernels.pdl import pdl_args, pdl_start


@triton.jit
def skinny_gemm_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, partial_ptr, counter_ptr, M, N, K, x_stride,
                       HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), SPLIT_K): y [M, N] = x [M, K] @ w [N, K]^T + bias, M <= BLOCK_M, x's rows
    x_stride apart. Program (n, s) computes the tile y^T [BLOCK_N, BLOCK_M] over the s-th of SPLIT_K
    slices of K (of whole BLOCK_K steps). SPLIT_K > 1: each stores its float32 tile to partial
    [SPLIT_K, M, N] and counts itself in counter [cdiv(N, BLOCK_N)] int32 (zero before the launch);
    the last of a tile sums the SPLIT_K partials in order, writes y and sets the counter back to 0."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
    k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_len
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = k_start + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + rm[None, :] * x_stride + rk[:, None]  # x^T: [BLOCK_K, BLOCK_M]
    # Masks against K, not the slice's end: slices end on whole BLOCK_K steps, and Triton knows
    # K divides by 16, so the loads stay vectorised.
    w = tl.load(w_ptrs, mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
    if PDL:
        gdc_wait()
    acc = tl.dot(w, tl.load(x_ptrs, mask=(rm[None, :] < M) & (rk[:, None] < K), other=0.0))
    for k in range(BLOCK_K, tl.minimum(k_len, K - k_start), BLOCK_K):
        w = tl.load(w_ptrs + k, mask=(rn[:, None] < N) & (rk[None, :] + k < K), other=0.0)
        acc = tl.dot(w, tl.load(x_ptrs + k, mask=(rm[None, :] < M) & (rk[:, None] + k < K), other=0.0), acc)
    y_offs = rm[None, :] * N + rn[:, None]
    y_mask = (rm[None, :] < M) & (rn[:, None] < N)
    if SPLIT_K > 1:
        tl.store(partial_ptr + pid_k * M * N + y_offs, acc, mask=y_mask)
        tl.debug_barrier()  # every thread's partial stored before the release below
        count = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        y_mask &= y_offs * 0 + count == SPLIT_K - 1  # a tensor: the interpreter takes no scalar in a mask
        acc = tl.load(partial_ptr + y_offs, mask=y_mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(partial_ptr + s * M * N + y_offs, mask=y_mask, other=0.0, cache_modifier=".cg")
        tl.store(counter_ptr + pid_n, 0, mask=count == SPLIT_K - 1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def rms_norm_rows_kernel(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, K, eps, HAS_RESIDUAL: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Grid (M,): one row of layernorm.RMSNorm, rounded as it rounds (r = x + residual in x's dtype,
    written to res_out; the mean of r^2 in float32; (r / rms) rounded, times w, rounded)."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64) * K
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    r = tl.load(x_ptr + row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = (r.to(tl.float32) + tl.load(res_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)).to(r.dtype)
        tl.store(res_out_ptr + row + cols, r, mask=mask)
    rf = r.to(tl.float32)
    normed = (rf * tl.rsqrt(tl.sum(rf * rf, 0) / K + eps)).to(r.dtype)
    tl.store(y_ptr + row + cols, normed * tl.load(w_ptr + cols, mask=mask, other=0.0), mask=mask)


@triton.jit
def silu_and_mul_rows_kernel(x_ptr, y_ptr, K, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Grid (M, cdiv(K, BLOCK_K)): y [M, K] = silu(gate) * up for x = [gate | up] [M, 2K], rounded as
    activation.silu_and_mul rounds it (silu in float32, rounded, times up, rounded)."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = cols < K
    gate = tl.load(x_ptr + row * 2 * K + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * K + K + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * K + cols, (gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up, mask=mask)


def skinny_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) for 16-bit weights, from sweeps on an H100 at
    Qwen3-0.6B's shapes (docs/perf-log.md, 2026-11-25, 2026-11-26) unless said.
    Up to 16 rows with K <= 3072: each program takes one K step in one stage, so it loads its whole
    weight slice before the PDL wait, and the grid leaves room on every SM for the next kernel's
    programs, which load theirs while this one runs: 32 weight rows per program (16 on 2 warps for
    N > 4096), all of K where that gives 128+ programs and K <= 1024, else K in 512-wide slices.
    In the chain (`benchmarks/decode_gemm.py`) a layer 25.1-26.0 -> 20.9-22.6 us at 2-16 rows; at
    24-32 rows the same rule lost (28.7 -> 30.5), and tilings of products timed alone miss this.
    Up to 16 rows with K > 3072 (Qwen3-8B's four products; a verify step's 1 + k rows of one
    sequence): 64 weight rows per program in 4 stages of 128-wide K steps, K split in 4 where N
    gives fewer than 128 tiles, 2 warps where it does not (gate_up_proj): from a sweep of each
    product alone at 5 rows on an H200 (gate_up_proj 55.1 -> 47.6 us), in the chain of a layer's
    products (`decode_gemm.py --model qwen3-8b`) 109.5 -> 105.0 us at 2 rows, 112.0 -> 106.6 at 5,
    112.3 -> 109.8 at 16 (docs/perf-log.md, 2026-11-28).
    At 17-32 rows 32 weight rows per program, K split in 4 where N gives fewer than 128 programs,
    4 stages, 2 warps where programs outnumber the SMs, and a split in 2 of 16-row tiles where 4
    slices would not be whole 512-wide steps (down_proj): a layer 30.4-30.8 -> 28.1-28.8 us.
    At 33-64 rows 64 weight rows per program (the full height of Hopper's MMA) in 128-wide K steps,
    K split in 4 for outputs of up to 2048 (o_proj, down_proj): a layer 33.1-33.4 -> 28.7-29.9 us
    against cuBLAS."""
    if m > 32:
        return 64, 128, 4, 4, 4 if n <= 2048 else 1
    if m <= 16 and k <= 3072:
        block_n, warps = (16, 2) if n > 4096 else (32, 4)
        if triton.cdiv(n, block_n) >= 128 and k <= 1024:
            return block_n, triton.next_power_of_2(k), warps, 1, 1
        return block_n, 512, warps, 1, triton.cdiv(k, 512)
    if m <= 16:  # K > 3072 (Qwen3-8B's products): the full MMA height in 4 stages of 128-wide steps
        split = 4 if triton.cdiv(n, 64) < 128 else 1
        return 64, 128, 4 if split > 1 else 2, 4, split
    block_n = 32  # 17-32 rows
    split = 4 if triton.cdiv(n, block_n) < 128 and k >= 1024 else 1
    if split == 4 and (k // 4) % 512:
        block_n, split = 16, 2
    block_k = 512 if (k // split) % 512 == 0 and n <= 4096 else 256
    programs = triton.cdiv(n, block_n) * split
    return block_n, block_k, 2 if programs > 132 else 4, 4, split


_counters: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split-K counters of a device, zero between launches (each launch leaves them at zero),
    allocated at the first launch, which must not be inside a CUDA graph's capture (the engine runs
    every graph's forward once before capturing it)."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_linear's first split-K launch on a device must come before graph capture")
        counters = _counters[device] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return counters


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16; rows may be strided, columns contiguous) @ weight [N, K]^T (x's dtype) +
    bias [N] -> [M, N] in x's dtype (written to out, contiguous, when given); M at most 64 (tiles of
    next_power_of_2(M) >= 16 rows).
    config: (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K), by default skinny_config's."""
    m = x.size(0)
    n, k = weight.shape
    if not 1 <= m <= 64:
        raise ValueError(f"skinny_linear takes 1 to 64 rows, got {m}")
    block_n, block_k, warps, stages, split = config or skinny_config(m, n, k)
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    tiles = triton.cdiv(n, block_n)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    counters = _tile_counters(x.device, tiles) if split > 1 else y
    skinny_gemm_kernel[(tiles, split)](
        x, weight, weight if bias is None else bias, y, partial, counters, m, n, k, x.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, num_stages=stages, **pdl_args(x.device))
    return y


def rms_norm_rows(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """layernorm.RMSNorm of x [M, K] (+ residual [M, K]) with weight [K], as a kernel of this chain:
    (RMSNorm(r) [M, K], r) for r = x + residual, or r = x."""
    x = x.contiguous()
    y = torch.empty_like(x)
    r = x if residual is None else torch.empty_like(x)
    rms_norm_rows_kernel[(x.size(0),)](
        x, x if residual is None else residual.contiguous(), weight, y, r, x.size(1), eps,
        HAS_RESIDUAL=residual is not None, BLOCK_K=triton.next_power_of_2(x.size(1)), num_warps=4,
        **pdl_args(x.device))
    return y, r


def silu_and_mul_rows(x: torch.Tensor) -> torch.Tensor:
    """activation.silu_and_mul of x = [gate | up] [M, 2K] -> [M, K], as a kernel of this chain."""
    x = x.contiguous()
    m, k = x.size(0), x.size(1) // 2
    y = torch.empty(m, k, dtype=x.dtype, device=x.device)
    silu_and_mul_rows_kernel[(m, triton.cdiv(k, 1024))](x, y, k, BLOCK_K=1024, num_warps=4, **pdl_args(x.device))
    return y
