"""One-row products y = x W^T + b (a decode step of one sequence) in one Triton kernel for bf16,
fp16 and float8 weights, with SwiGLU's silu(gate) * up, or the RMSNorm (and residual add) before
the product, computed while loading x.

At one row a product only streams its weights; cuBLAS then picks tensor-core tilings that leave
bandwidth unused. Measured on an H100 (benchmarks/gemv.py; a CUDA graph of 28 layers' products,
us per layer's four): Qwen3-0.6B 27.5 with cuBLAS, 19.6 with this kernel; Qwen3-8B 154.7 and
134.3; Qwen3-8B's float8 weights 105.1 with the tensor-core W8A16 kernel, 86.4 with this one.
Fusing silu * up into down_proj's loads saves one kernel per layer (9.0 -> 5.2 us at 0.6B). The
first weight tile is loaded before waiting for the previous kernel (weights never depend on it),
which lets the RMSNorm's pass over x hide behind the weight loads: RMSNorm + qkv_proj 6.47 ->
5.07 us at 0.6B, 20.89 -> 18.48 at 8B (docs/perf-log.md, 2026-11-24).
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanovllm.kernels.pdl import pdl_args


@triton.jit
def _input(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, normed_ptr, offs, K, inv_rms, res_cols, GATED: tl.constexpr,
           NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STORE_NORMED: tl.constexpr):
    """The product's input a[offs] in float32, rounded to x's dtype where the torch layers round it
    (see gemv_kernel); x + residual is written to res_out, and with STORE_NORMED a to normed,
    where offs < res_cols."""
    mask = offs < K
    if GATED:
        gate = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + offs, mask=mask, other=0.0)
        a = ((gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up).to(tl.float32)
    elif NORM:
        r = _residual_sum(x_ptr, res_ptr, offs, K, HAS_RESIDUAL)
        if HAS_RESIDUAL:  # a mask, not a branch on the program id: the loop stays one basic block
            tl.store(res_out_ptr + offs, r, mask=offs < res_cols)
        normed = (r.to(tl.float32) * inv_rms).to(r.dtype).to(tl.float32)
        a = (normed * tl.load(norm_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(r.dtype)
        if STORE_NORMED:
            tl.store(normed_ptr + offs, a, mask=offs < res_cols)
        a = a.to(tl.float32)
    else:
        a = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return a


@triton.jit
def _residual_sum(x_ptr, res_ptr, offs, K, HAS_RESIDUAL: tl.constexpr):
    """x + residual at offs, summed in x's dtype (as the model adds them), or x alone."""
    r = tl.load(x_ptr + offs, mask=offs < K, other=0.0)
    if HAS_RESIDUAL:
        r = (r.to(tl.float32) + tl.load(res_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)).to(r.dtype)
    return r


@triton.jit
def widen(w, SCALED: tl.constexpr):
    """Weights in float32; float8 (SCALED) ones through float16, which holds every e4m3 value, as
    Triton's direct cast is slower: a layer's four products at Qwen3-8B's shapes 78.6 -> 75.3 us on
    an H100 (docs/perf-log.md, 2026-11-25). fused_moe.py's pair kernels widen their weights so too."""
    if SCALED:
        return w.to(tl.float16).to(tl.float32)
    return w.to(tl.float32)


@triton.jit
def _dot_rows(x_ptr, w_ptr, rn, N, K, eps, res_ptr, norm_w_ptr, res_out_ptr, normed_ptr, res_cols,
              SCALED: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              STORE_NORMED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """(w [N, K] @ a)[rn] in float32 [BLOCK_N], rows past N 0 (gemv_kernel says what a is). With
    PDL the first weight tile is loaded before the wait for the previous kernel."""
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
    w = tl.load(w_ptrs, mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
    if PDL:
        gdc_wait()
    inv_rms = 1.0
    if NORM:  # the first BLOCK_K outside the loop: for K <= BLOCK_K there is no loop
        r = _residual_sum(x_ptr, res_ptr, rk, K, HAS_RESIDUAL).to(tl.float32)
        sq = r * r
        for k in range(BLOCK_K, K, BLOCK_K):
            r = _residual_sum(x_ptr, res_ptr, k + rk, K, HAS_RESIDUAL).to(tl.float32)
            sq += r * r
        inv_rms = tl.rsqrt(tl.sum(sq, 0) / K + eps)
    a = _input(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, normed_ptr, rk, K, inv_rms, res_cols, GATED, NORM,
               HAS_RESIDUAL, STORE_NORMED)
    acc = widen(w, SCALED) * a[None, :]
    for k in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        w = tl.load(w_ptrs, mask=(rn[:, None] < N) & (k + rk[None, :] < K), other=0.0)
        a = _input(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, normed_ptr, k + rk, K, inv_rms, res_cols, GATED, NORM,
                   HAS_RESIDUAL, STORE_NORMED)
        acc += widen(w, SCALED) * a[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _shrink_words(s_ptr, rn, N, R, B1, B2, BLOCK_R: tl.constexpr):
    """The words of s that rows rn read (gemv_kernel): their slice's R, as (pointers, mask)
    [BLOCK_N, BLOCK_R], for the slices [0, B1), [B1, B2), [B2, N)."""
    r = tl.arange(0, BLOCK_R)
    j = (rn >= B1).to(tl.int32) + (rn >= B2).to(tl.int32)
    return s_ptr + j[:, None] * R + r[None, :], (rn[:, None] < N) & (r[None, :] < R)


@triton.jit
def _lora_delta(y, b, words, ptrs, mask):
    """y + s B[slot, rn]^T in float32 [BLOCK_N] for b = B[slot, rn] [BLOCK_N, BLOCK_R] and the
    words of s at ptrs (_shrink_words), read again until each has its flag (words: a first read)."""
    if tl.min(tl.min(words >> 16, 1), 0) == 0:
        # volatile: from L2, as other SMs write it. The loop carries no tensor: a loop that carried
        # the words read came out with a first read's on the H200 (Triton 3.6)
        while tl.min(tl.min(tl.load(ptrs, mask=mask, other=0x10000, volatile=True) >> 16, 1), 0) == 0:
            pass
        words = tl.load(ptrs, mask=mask, other=0x10000, volatile=True)
    s = (words & 0xFFFF).to(tl.int16).to(b.dtype, bitcast=True)
    return y + tl.sum(s.to(tl.float32) * b.to(tl.float32), 1)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, res_ptr, norm_w_ptr, res_out_ptr, normed_ptr, lora_a_ptr,
                lora_b_ptr, tiles_ptr, s_ptr, N, K, eps, SR, s_words, R, B1, B2, lora_programs, SCALED: tl.constexpr,
                HAS_BIAS: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                STORE_NORMED: tl.constexpr, LORA: tl.constexpr, COPIES: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """Grid (lora_programs + cdiv(N, BLOCK_N),): y [N] = (w [N, K] @ a) * scale + bias, one program
    per BLOCK_N rows of w streamed along K (contiguous loads, products in float32, summed along K
    once at the end; no tensor cores). a = x [K]; with GATED silu(x[:K]) * x[K:] for x [2K],
    rounded to x's dtype as silu_and_mul rounds it; with NORM RMSNorm(r) * norm_w for r = x +
    residual (HAS_RESIDUAL, summed in x's dtype; program 0 writes it to res_out, and a to normed
    with STORE_NORMED) or r = x, as layernorm.RMSNorm rounds it: the mean of r^2 in float32 over a
    first pass of r. scale [N] float32 (float8 weights: W = w * scale per row). With PDL the first weight tile is loaded
    before the wait for the previous kernel, everything that kernel may write after it.

    LORA: the row's adapter (slot = tiles[0], -1 none; layers/lora.py's mapping) in the same
    launch. Programs below lora_programs compute s = a @ A[slot]^T (lora_a [max_loras, SR, K],
    SR = S * R for S slices of rank R) as the others compute y, rounded to the model dtype (as
    PEFT rounds it), and store each value as a word (1 << 16 | its 16 bits) in every one of
    COPIES copies (s [COPIES, s_words] int32, zero before the launch). The others add
    s B[slot]^T (lora_b [max_loras, N, R]) to their rounded y once the words they read from
    their copy all have the flag: a value and its flag arrive in one store, so there is no count
    to order against (NCCL's LL protocol), and one round trip to L2 rather than two; a first read
    before the product finds s there for programs that start after the shrink's. The copies
    spread every program's read of the same lines (~1 us of a launch of 1024 programs on an
    H200). Waiting inside a launch is safe as the waiting programs come after the ones they wait
    for (blocks are dispatched in order, as CUTLASS's serial split-K semaphore assumes), and
    Triton's interpreter runs programs in order."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    res_cols = K * (pid == 0).to(tl.int32)  # program 0 writes x + residual
    slot = -1
    shrink = False
    if LORA:
        slot = tl.load(tiles_ptr)
        shrink = pid < lora_programs
    if shrink:
        rs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        s = _dot_rows(x_ptr, lora_a_ptr + tl.maximum(slot, 0).to(tl.int64) * SR * K, rs, SR, K, eps, res_ptr,
                      norm_w_ptr, res_out_ptr, normed_ptr, res_cols, False, GATED, NORM, HAS_RESIDUAL, STORE_NORMED,
                      BLOCK_N, BLOCK_K, PDL)
        if slot >= 0:
            copies = tl.arange(0, COPIES)
            words = (s.to(lora_a_ptr.dtype.element_ty).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | 0x10000
            tl.store(s_ptr + copies[:, None] * s_words + rs[None, :], words[None, :], mask=(rs < SR)[None, :])
    else:
        rn = (pid - lora_programs) * BLOCK_N + tl.arange(0, BLOCK_N)
        if LORA:  # B's rows and a first read of s before the product: neither depends on the previous kernel
            r = tl.arange(0, BLOCK_R)
            b = tl.load(lora_b_ptr + tl.maximum(slot, 0).to(tl.int64) * N * R + rn[:, None] * R + r[None, :],
                        mask=(rn[:, None] < N * (slot >= 0).to(tl.int32)) & (r[None, :] < R), other=0.0)
            s_ptrs, s_mask = _shrink_words(s_ptr + (pid % COPIES) * s_words, rn, N, R, B1, B2, BLOCK_R)
            words = tl.load(s_ptrs, mask=s_mask, other=0x10000, volatile=True)  # there for programs of later waves
        # scale and bias before the wait too, so that their round trip to memory overlaps the
        # product instead of ending every program
        if SCALED:
            scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        y = _dot_rows(x_ptr, w_ptr, rn, N, K, eps, res_ptr, norm_w_ptr, res_out_ptr, normed_ptr, res_cols, SCALED,
                      GATED, NORM, HAS_RESIDUAL, STORE_NORMED, BLOCK_N, BLOCK_K, PDL)
        if SCALED:
            y *= scale
        if HAS_BIAS:
            y += bias
        if LORA:
            if slot >= 0:  # the base product rounded, then the delta added (as add_lora adds it)
                y = _lora_delta(y.to(y_ptr.dtype.element_ty).to(tl.float32), b, words, s_ptrs, s_mask)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)


def gemv_config(k: int, weight_dtype: torch.dtype, lora: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages). K <= 3072 (Qwen3-0.6B): each program's whole slice
    of K in one tile, 4 rows of 16-bit or 8 of float8 weights, so a grid is one wave that leaves room
    on every SM: the next kernel's programs become resident under PDL while this one runs and load
    their weights before they wait. In a chain of 28 layers' four products (H100, us per layer):
    bf16 19.1 -> 15.9, float8 15.5 -> 13.6, where the tilings that win alone (2 rows of 1024-wide
    steps) lose (docs/perf-log.md, 2026-11-26). Larger K keeps the fastest tilings of a
    sweep of products alone (benchmarks/gemv.py --sweep): 2048-wide steps and 4 rows per program
    for K >= 4096 (Qwen3-8B), where all of K in one tile gained nothing in bf16 and lost with float8
    weights (100.1-142.2 us per 8B layer over such tilings against 88.3); between the two, not
    measured in a chain, 1024-wide steps of 2 rows (16-bit) or 4 (float8).
    With an adapter in the launch (lora, 16-bit weights), where every program waits for s at its
    end, larger tiles win in a chain of Qwen3-0.6B's products: 16 rows of 512-wide steps for K <=
    1024 (qkv_proj, gate_up_proj) and 8 rows in 8 warps for down_proj's K of 3072 (H200, 28 layers'
    four products with one adapter: +5.0-5.3 -> +3.8-4.4 us a layer over the base chain; one
    sequence with an adapter 0.921 -> 0.911 ms/token; docs/perf-log.md, 2026-11-28)."""
    if lora and weight_dtype.itemsize == 2 and k <= 1024:
        return 16, min(512, triton.next_power_of_2(k)), 4, 2
    if lora and weight_dtype.itemsize == 2 and 2048 < k <= 3072:
        return 8, triton.next_power_of_2(k), 8, 1
    if k <= 3072:
        block_k = triton.next_power_of_2(k)
        return (4, block_k, 4, 1) if weight_dtype.itemsize == 2 else (8, block_k, 8, 1)
    if k >= 4096:
        return 4, 2048, 4, 4
    return (2, 1024, 4, 3) if weight_dtype.itemsize == 2 else (4, 1024, 4, 4)


class GemvLoRA(NamedTuple):
    """The adapter of a one-row product, applied in the product's own launch (gemv_kernel's LORA):
    lora_a [max_loras, S * R, K] and lora_b [max_loras, N, R] in the model dtype (layers/lora.py's
    slot tables, B scaled by alpha / r), tiles int32 whose first entry is the row's slot (-1: none;
    layers/lora.py's mapping), bounds (0, ..., N): the S <= 3 slices' first output columns and N,
    s: int32 [copies (a power of two), words >= S * R] zeros on x's device where the launch passes s between its
    programs (left non-zero: zero it again before the next launch that takes it)."""
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    tiles: torch.Tensor
    bounds: tuple[int, ...]
    s: torch.Tensor


def gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, gated: bool = False,
         config: tuple[int, int, int, int] | None = None, out: torch.Tensor | None = None,
         lora: GemvLoRA | None = None) -> torch.Tensor:
    """x [..., K] with one row (bf16/fp16, CUDA; [..., 2K] = [gate | up] when gated) @ (weight [N, K]
    in x's dtype or float8 e4m3 times weight_scale [N] float32 per row)^T + bias [N] -> [..., N] in
    x's dtype, written to out (contiguous) when given, plus lora's delta. config: (BLOCK_N,
    BLOCK_K, num_warps, num_stages), by default gemv_config's."""
    return _launch(x, weight, weight_scale, bias, config, gated=gated, out=out, lora=lora)


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, weight_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              config: tuple[int, int, int, int] | None = None, lora: GemvLoRA | None = None,
              normed_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gemv(RMSNorm(r) * norm_weight) and r, for r = x + residual [..., K] (x alone when residual is
    None; one row, x's dtype) as layernorm.RMSNorm computes it: (y [..., N], r [..., K]); the
    normed input RMSNorm(r) * norm_weight written to normed_out (contiguous, x's shape) when given."""
    x = x.contiguous()
    r = x if residual is None else torch.empty_like(x)
    assert normed_out is None or (normed_out.is_contiguous() and normed_out.shape == x.shape)
    y = _launch(x, weight, weight_scale, bias, config, norm=(residual, norm_weight, eps, r, normed_out), lora=lora)
    return y, r


def _launch(x, weight, weight_scale, bias, config, gated=False, norm=None, out=None, lora=None):
    n, k = weight.shape
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device) if out is None else out
    residual, norm_weight, eps, res_out, normed = norm or (None, None, 0.0, None, None)
    block_n, block_k, warps, stages = config or gemv_config(k, weight.dtype, lora is not None)
    sr, rank, programs, b1, b2, copies, words = 0, 0, 0, n, n, 1, 0
    if lora is not None:
        sr, rank = lora.lora_a.size(1), lora.lora_b.size(2)
        assert lora.lora_a.size(2) == k and lora.lora_b.size(1) == n == lora.bounds[-1] and lora.lora_a.dtype == x.dtype
        assert sr == (len(lora.bounds) - 1) * rank and len(lora.bounds) <= 4
        b1, b2 = (list(lora.bounds[1:-1]) + [n, n])[:2]
        programs = triton.cdiv(sr, block_n)
        copies, words = lora.s.shape
        assert lora.s.dtype == torch.int32 and lora.s.is_contiguous() and words >= sr and copies & (copies - 1) == 0
    gemv_kernel[(programs + triton.cdiv(n, block_n),)](
        x, weight, weight if weight_scale is None else weight_scale, weight if bias is None else bias, y,
        x if residual is None else residual.contiguous(), x if norm is None else norm_weight,
        x if res_out is None else res_out, x if normed is None else normed,
        *(x,) * 4 if lora is None else (lora.lora_a, lora.lora_b, lora.tiles, lora.s),
        n, k, eps, sr, words, rank, b1, b2, programs,
        SCALED=weight_scale is not None, HAS_BIAS=bias is not None, GATED=gated, NORM=norm is not None,
        HAS_RESIDUAL=residual is not None, STORE_NORMED=normed is not None, LORA=lora is not None, COPIES=copies,
        BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_R=triton.next_power_of_2(max(rank, 1)), num_warps=warps, num_stages=stages, **pdl_args(x.device))
    return y
