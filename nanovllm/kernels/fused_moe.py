"""The experts of a mixture-of-experts layer (SwiGLU experts, as Qwen3-MoE's and Mixtral's) as two
Triton GEMMs: h = silu(x W_gate^T) * (x W_up^T) per token-expert pair, then each token's routing-
weighted sum over its top-k experts of h W_down^T. fused_experts picks one of two paths by size;
fused_moe, the layer from its router's logits, chooses the experts first (moe_routing.moe_topk).

Pairs (few tokens: a decode step of a few sequences): one program per (pair, output tile) for the
gate/up product and per (token, output tile) for the down product, whose tile holds all the
token's experts, so that their weight loads are in flight together, and sums their products in
registers: no sort, no padding, no intermediate [pairs, hidden] tensor, two launches (with
programmatic dependent launch, pdl.py, as the GEMVs), the first of which chooses each pair's
expert from the logits itself (fused_moe), where moe_topk would be a third. Each pair reads its
expert's weights, so an expert chosen by two of the step's tokens is read twice
(from L2 the second time, when the two run together): a cost that grows with the batch, which
is why larger steps take the other path.

Sorted (more tokens; vLLM's fused_moe design): the pairs are grouped by expert and padded to
tiles of BLOCK_M rows (moe_routing.moe_align_block_size); each program of a grouped GEMM takes one
tile, whose pairs share one expert, and multiplies on the tensor cores (tl.dot), reading that
expert's weights once per tile. The down GEMM multiplies each pair's routing weight into its
row; a sum over each token's top_k rows ends it (moe_sum). Programs of tiles past the padded count return
at once, so the grid is sized by the token count alone and CUDA graphs capture it.

Expert parallelism: a pair whose expert id is -1 (another rank's expert: FusedMoE's expert_map)
is skipped by both paths, its product taken as 0: the pair kernels return or skip it, the sorted
layout leaves it out of every tile (it sorts before expert 0).

Weights: w13 [E, 2N, H] ([gate | up] rows of each expert, N = this rank's share of the expert's
intermediate size) and w2 [E, H, N], in the model dtype, or float8 e4m3 with a float32 scale per
output row (w13_scale [E, 2N], w2_scale [E, H]) widened to the activations' dtype in registers.
Tiles come from MoEConfig; default_config picks them by the step's size (benchmarks/moe.py
measures the candidates).
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.gemv import widen
from nanovllm.kernels.moe_routing import max_padded_slots, moe_align_block_size, moe_topk, topk_ids, topk_weights
from nanovllm.kernels.pdl import pdl_args, pdl_start


@dataclass(frozen=True)
class MoEConfig:
    """How fused_experts runs. pairs: the pair path (else sorted). block_m, block_n, block_k,
    group_m, num_warps, num_stages: the sorted path's tiles (group_m tiles along M share their
    weight tiles' columns in L2 before moving along N). The pair path: pair_n, pair_k: its gate/up
    product's weight rows per program and K step (None: the whole K, up to 2048, in one step);
    down_n, down_k: its down product's rows per program and K step, for all of a token's experts in
    one tile; pair_stages: the software pipeline's stages of both K loops (a step's loads issued
    while the one before is summed); pair_warps: both kernels' warps. The defaults are the fastest
    at one token (default_config says where from)."""
    pairs: bool = False
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    pair_n: int = 16
    pair_k: int | None = 256
    pair_warps: int = 4
    down_n: int = 4
    down_k: int = 256
    pair_stages: int = 3


# up to this many tokens the pair path: at 8 tokens, tilings next to its defaults (one K-loop stage)
# beat the sorted path's, bf16 173 against 186 us per layer, fp8 108 against 122-140 (benchmarks/moe.py
# --sweep, H100)
PAIRS_MAX_TOKENS = 8


def default_config(num_tokens: int, top_k: int, num_experts: int) -> MoEConfig:
    """The tiles for a step of num_tokens tokens: the pair path for a few tokens; then tiles that
    grow with the pairs per expert (num_tokens * top_k / num_experts). Chosen with benchmarks/moe.py
    --sweep on an H100 at Qwen3-30B-A3B's shapes (128 experts, top 8), the fastest per size, us
    per layer: 64 tokens 433 (16-row tiles), 256 tokens 455 (32-row tiles), 4096 tokens 939 (128 x
    128 tiles, 8 warps; 64 x 128 tiles: 1055). The pair path's two kernels timed apart (H100, one
    token; bf16 and fp8): gate/up 19.2 and 11.4 us, down 11.0 and 6.6 us; 4 warps beat 8, and three
    pipeline stages beat one by 1 us on fp8's gate/up. One pair tiling for both dtypes, fp8's: with
    the routing inside the gate/up kernel, bf16 at one token 29.5 -> 26.7 us a layer and 8 tokens
    133.5 -> 125.4 against its former 8 rows of 512-wide steps (H200; benchmarks/moe.py's pair
    tilings and timer, from the router's logits): its 768 programs, at 48 KB of pipeline buffers
    each by our count (not profiled), run in two waves that each choose the experts. vLLM keeps such
    choices as tuned JSON per GPU and shape; one rule by pairs per expert stands in for them until
    another GPU or shape measures differently."""
    if num_tokens <= PAIRS_MAX_TOKENS:
        return MoEConfig(pairs=True)
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 8:
        return MoEConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3)
    if per_expert <= 64:
        return MoEConfig(block_m=32, block_n=64, block_k=128, group_m=4, num_warps=4, num_stages=3)
    return MoEConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)


@triton.jit
def _silu_mul(gate, up):
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def moe_gate_up_pairs_kernel(x_ptr, w_ptr, scale_ptr, ids_ptr, h_ptr, N, K, logits_ptr, logits_stride, E, map_ptr,
                             weights_ptr, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, ROUTE: tl.constexpr,
                             RENORMALIZE: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_E: tl.constexpr,
                             TOP_K_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             STAGES: tl.constexpr, PDL: tl.constexpr):
    """Grid (num_pairs, cdiv(N, BLOCK_N)): h[p, n] = silu(x[t] . gate_e[n]) * (x[t] . up_e[n]) for
    pair p = t * TOP_K + j of expert e = ids[p], over this program's BLOCK_N columns n; x [T, K],
    w [E, 2N, K], h [num_pairs, N]; products summed in float32 (as a GEMV: one row). A pair of
    expert -1 is skipped (its row of h is left as it was: down_pairs does not read it).

    ROUTE: the program chooses e itself, token t's j-th expert by moe_routing.topk_ids of logits
    [T, E] (rows logits_stride apart), taken through map [E] int32 with HAS_MAP (expert
    parallelism); the programs of the first column write e to ids [num_pairs] int32 and, after
    their product, the routing weight (moe_routing.topk_weights) to weights [num_pairs] float32
    for down_pairs (not for a skipped pair, whose weight down_pairs does not read). Every program
    of the token makes the same choice: a launch fewer than moe_topk before this kernel."""
    pdl_start(PDL)
    pair, pid_n = tl.program_id(0), tl.program_id(1)
    if ROUTE:
        logits, ids, chosen = topk_ids(logits_ptr + (pair // TOP_K).to(tl.int64) * logits_stride, E, TOP_K, BLOCK_E,
                                       TOP_K_P2)
        mine = tl.arange(0, TOP_K_P2) == pair % TOP_K
        expert = tl.sum(tl.where(mine, ids, 0), 0)
        if HAS_MAP:
            expert = tl.load(map_ptr + expert)
        tl.store(ids_ptr + pair, expert, mask=pid_n == 0)
        expert = expert.to(tl.int64)
    else:
        expert = tl.load(ids_ptr + pair).to(tl.int64)
    if expert < 0:
        return
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_SCALE:  # issued before the product, whose loads hide its round trip
        gate_scale = tl.load(scale_ptr + expert * 2 * N + rn, mask=rn < N, other=0.0)
        up_scale = tl.load(scale_ptr + expert * 2 * N + N + rn, mask=rn < N, other=0.0)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pair // TOP_K).to(tl.int64) * K + rk
    gate_ptrs = w_ptr + expert * 2 * N * K + rn[:, None] * K + rk[None, :]
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = tl.load(x_ptrs + k, mask=rk + k < K, other=0.0).to(tl.float32)[None, :]
        mask = (rn[:, None] < N) & (rk[None, :] + k < K)
        acc_gate += widen(tl.load(gate_ptrs + k, mask=mask, other=0.0), HAS_SCALE) * x
        acc_up += widen(tl.load(gate_ptrs + N * K + k, mask=mask, other=0.0), HAS_SCALE) * x
    gate, up = tl.sum(acc_gate, 1), tl.sum(acc_up, 1)
    if HAS_SCALE:
        gate *= gate_scale
        up *= up_scale
    tl.store(h_ptr + pair.to(tl.int64) * N + rn, _silu_mul(gate, up).to(h_ptr.dtype.element_ty), mask=rn < N)
    if ROUTE:  # the weight after the product: off the path to the first weight loads
        tl.store(weights_ptr + pair, tl.sum(tl.where(mine, topk_weights(logits, chosen, RENORMALIZE), 0.0), 0),
                 mask=pid_n == 0)


@triton.jit
def moe_down_pairs_kernel(h_ptr, w_ptr, scale_ptr, ids_ptr, weights_ptr, out_ptr, out_stride, N, K,
                          TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """Grid (T, cdiv(N, BLOCK_N)): out[t, n] = sum_j weights[t, j] * (h[t * TOP_K + j] . down_e[n])
    for e = ids[t, j] (pairs of expert -1 skipped); h [T * TOP_K, K], w [E, N, K], out [T, N]
    (rows out_stride apart), all sums in float32. The token's TOP_K experts are one [TOP_K_P2,
    BLOCK_N, BLOCK_K] tile, so their weight loads are in flight together: a loop over the experts
    waits for each expert's load in turn, which at one token costs more than the bytes."""
    pdl_start(PDL)
    token, pid_n = tl.program_id(0), tl.program_id(1)
    pairs = token.to(tl.int64) * TOP_K + tl.arange(0, TOP_K_P2)
    experts = tl.load(ids_ptr + pairs, mask=tl.arange(0, TOP_K_P2) < TOP_K, other=-1).to(tl.int64)
    live = experts >= 0
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + experts[:, None, None] * N * K + rn[None, :, None] * K + rk[None, None, :]
    w_mask = live[:, None, None] & (rn[None, :, None] < N)
    # the routing weights (and scales) before the product, whose loads hide their round trip
    route = tl.load(weights_ptr + pairs, mask=live, other=0.0)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + experts[:, None] * N + rn[None, :], mask=live[:, None] & (rn[None, :] < N), other=0.0)
    acc = tl.zeros([TOP_K_P2, BLOCK_N, BLOCK_K], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        h = tl.load(h_ptr + pairs[:, None] * K + k + rk[None, :], mask=live[:, None] & (rk[None, :] + k < K),
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + k, mask=w_mask & (rk[None, None, :] + k < K), other=0.0)
        acc += widen(w, HAS_SCALE) * h[:, None, :]
    y = tl.sum(acc, 2)  # [TOP_K_P2, BLOCK_N]
    if HAS_SCALE:
        y *= scale
    y *= route[:, None]
    tl.store(out_ptr + token.to(tl.int64) * out_stride + rn, tl.sum(y, 0).to(out_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _tile(N, num_m_tiles, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (tile along M, tile along N): GROUP_M consecutive programs take GROUP_M tiles
    along M of one column of N tiles, so that they share that column's weight tiles in L2."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size
    pid_n = (pid % (GROUP_M * num_n)) // size
    return pid_m, pid_n


@triton.jit
def _tile_pairs(sorted_ids_ptr, expert_ids_ptr, num_pairs, pid_m, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """Tile (pid_m, pid_n)'s pairs [BLOCK_M] (sorted_ids' slots; num_pairs: padding), which are
    real, their expert (int64), its BLOCK_N output columns and the BLOCK_K offsets along K."""
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    return pairs, pairs < num_pairs, expert, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)


@triton.jit
def moe_gate_up_kernel(x_ptr, w_ptr, scale_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, h_ptr, N, K,
                       num_pairs, num_m_tiles, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Grid (num_m_tiles * cdiv(N, BLOCK_N),): the tile of pairs sorted_ids[m * BLOCK_M:][:BLOCK_M]
    (one expert, expert_ids[m]; slots holding num_pairs are padding), h[pair, n] = silu(x[t] .
    gate_e[n]) * (x[t] . up_e[n]) for its BLOCK_N columns; x [T, K], w [E, 2N, K], h [num_pairs,
    N]. Tensor-core products (float32: IEEE, not TF32), accumulated in float32."""
    pid_m, pid_n = _tile(N, num_m_tiles, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):  # a tile past the pairs (the grid is sized for the most)
        return
    pairs, valid, expert, rn, rk = _tile_pairs(sorted_ids_ptr, expert_ids_ptr, num_pairs, pid_m, pid_n, BLOCK_M,
                                               BLOCK_N, BLOCK_K)
    x_ptrs = x_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * K + rk[None, :]
    gate_ptrs = w_ptr + expert * 2 * N * K + rn[None, :] * K + rk[:, None]  # [BLOCK_K, BLOCK_N]
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs + k, mask=valid[:, None] & (rk[None, :] + k < K), other=0.0)
        mask = (rk[:, None] + k < K) & (rn[None, :] < N)
        gate = tl.load(gate_ptrs + k, mask=mask, other=0.0).to(x.dtype)
        up = tl.load(gate_ptrs + N * K + k, mask=mask, other=0.0).to(x.dtype)
        acc_gate = tl.dot(x, gate, acc_gate, input_precision="ieee" if IEEE else None)
        acc_up = tl.dot(x, up, acc_up, input_precision="ieee" if IEEE else None)
    if HAS_SCALE:
        acc_gate *= tl.load(scale_ptr + expert * 2 * N + rn, mask=rn < N, other=0.0)[None, :]
        acc_up *= tl.load(scale_ptr + expert * 2 * N + N + rn, mask=rn < N, other=0.0)[None, :]
    h = _silu_mul(acc_gate, acc_up).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + pairs.to(tl.int64)[:, None] * N + rn[None, :], h, mask=valid[:, None] & (rn[None, :] < N))


@triton.jit
def moe_down_kernel(h_ptr, w_ptr, scale_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, weights_ptr, y_ptr,
                    N, K, num_pairs, num_m_tiles, HAS_SCALE: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Grid (num_m_tiles * cdiv(N, BLOCK_N),): for the tile of pairs as in moe_gate_up_kernel,
    y[pair, n] = weights[pair] * (h[pair] . down_e[n]); h [num_pairs, K], w [E, N, K], weights
    [num_pairs] float32, y [num_pairs, N]."""
    pid_m, pid_n = _tile(N, num_m_tiles, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):  # a tile past the pairs (the grid is sized for the most)
        return
    pairs, valid, expert, rn, rk = _tile_pairs(sorted_ids_ptr, expert_ids_ptr, num_pairs, pid_m, pid_n, BLOCK_M,
                                               BLOCK_N, BLOCK_K)
    h_ptrs = h_ptr + pairs.to(tl.int64)[:, None] * K + rk[None, :]
    w_ptrs = w_ptr + expert * N * K + rn[None, :] * K + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        h = tl.load(h_ptrs + k, mask=valid[:, None] & (rk[None, :] + k < K), other=0.0)
        w = tl.load(w_ptrs + k, mask=(rk[:, None] + k < K) & (rn[None, :] < N), other=0.0).to(h.dtype)
        acc = tl.dot(h, w, acc, input_precision="ieee" if IEEE else None)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + expert * N + rn, mask=rn < N, other=0.0)[None, :]
    acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(y_ptr + pairs.to(tl.int64)[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=valid[:, None] & (rn[None, :] < N))


@triton.jit
def moe_sum_kernel(y_ptr, out_ptr, out_stride, H, TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    """Grid (T, cdiv(H, BLOCK_H)): out[t] = sum_j y[t * TOP_K + j], summed in float32 and rounded
    once, as torch.sum rounds it; y [T * TOP_K, H], out [T, H] (rows out_stride apart)."""
    token, pid = tl.program_id(0), tl.program_id(1)
    rh = pid * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, TOP_K_P2)
    y = tl.load(y_ptr + (token.to(tl.int64) * TOP_K + j)[:, None] * H + rh[None, :],
                mask=(j[:, None] < TOP_K) & (rh[None, :] < H), other=0.0).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * out_stride + rh, tl.sum(y, 0).to(out_ptr.dtype.element_ty), mask=rh < H)


def moe_sum(y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The sorted path's top-k sum: y [T * top_k, H] -> out [T, H] (rows may be strided). One read
    of y, where torch.sum's reduction over the middle dimension read it at under a third of the
    copy bandwidth (256 tokens of Qwen3-30B-A3B, 8.4 MB: 6.8 us a layer on an H200)."""
    (num_tokens, hidden), top_k = out.shape, y.size(0) // max(out.size(0), 1)
    block_h = min(1024, triton.next_power_of_2(hidden))
    moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](y, out, out.stride(0), hidden, TOP_K=top_k,
                                                               TOP_K_P2=triton.next_power_of_2(top_k),
                                                               BLOCK_H=block_h, num_warps=4)
    return out


def _pair_k(config: MoEConfig, k: int) -> int:
    return config.pair_k or min(triton.next_power_of_2(k), 2048)


def gate_up_pairs(x, w13, w13_scale, topk_ids, config: MoEConfig, out=None, route=None) -> torch.Tensor:
    """The pair path's first GEMM: h [num_pairs, N] in x's dtype (see moe_gate_up_pairs_kernel).
    route: (router_logits [T, E], renormalize, topk_weights [T, k] float32, expert_map or None) to
    choose the experts in the kernel (its ROUTE), which writes topk_ids and topk_weights."""
    num_pairs, n = topk_ids.numel(), w13.size(1) // 2
    h = out if out is not None else torch.empty(num_pairs, n, dtype=x.dtype, device=x.device)
    logits, renormalize, weights, expert_map = route or (x, False, x, None)
    moe_gate_up_pairs_kernel[(num_pairs, triton.cdiv(n, config.pair_n))](
        x, w13, w13_scale, topk_ids, h, n, x.size(1), logits, logits.stride(0), logits.size(1),
        expert_map if expert_map is not None else topk_ids, weights, TOP_K=topk_ids.size(1),
        HAS_SCALE=w13_scale is not None, ROUTE=route is not None, RENORMALIZE=renormalize,
        HAS_MAP=expert_map is not None, BLOCK_E=triton.next_power_of_2(logits.size(1)),
        TOP_K_P2=triton.next_power_of_2(topk_ids.size(1)), BLOCK_N=config.pair_n,
        BLOCK_K=_pair_k(config, x.size(1)), STAGES=config.pair_stages, num_warps=config.pair_warps,
        **pdl_args(x.device))
    return h


def down_pairs(h, w2, w2_scale, topk_ids, topk_weights, out, config: MoEConfig) -> torch.Tensor:
    """The pair path's second GEMM with the top-k sum: out [T, H] (rows may be strided)."""
    num_tokens, hidden = out.shape
    top_k = topk_ids.size(1)
    moe_down_pairs_kernel[(num_tokens, triton.cdiv(hidden, config.down_n))](
        h, w2, w2_scale, topk_ids, topk_weights, out, out.stride(0), hidden, h.size(1), TOP_K=top_k,
        TOP_K_P2=triton.next_power_of_2(top_k), HAS_SCALE=w2_scale is not None, BLOCK_N=config.down_n,
        BLOCK_K=min(config.down_k, triton.next_power_of_2(h.size(1))), STAGES=config.pair_stages,
        num_warps=config.pair_warps, **pdl_args(h.device))
    return out


def _sorted_launch(kernel, n: int, num_pairs: int, num_experts: int, config: MoEConfig, *args, **constexprs):
    m_tiles = triton.cdiv(max_padded_slots(num_pairs, num_experts, config.block_m), config.block_m)
    kernel[(m_tiles * triton.cdiv(n, config.block_n),)](
        *args, num_pairs, m_tiles, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages, **constexprs)


def gate_up_sorted(x, w13, w13_scale, topk_ids, align, config: MoEConfig, out=None) -> torch.Tensor:
    """The sorted path's first GEMM: h [num_pairs, N] in x's dtype; align: moe_align_block_size's
    output for config.block_m."""
    num_pairs, (num_experts, n2, _) = topk_ids.numel(), w13.shape
    h = out if out is not None else torch.empty(num_pairs, n2 // 2, dtype=x.dtype, device=x.device)
    _sorted_launch(moe_gate_up_kernel, n2 // 2, num_pairs, num_experts, config, x, w13, w13_scale, *align, h, n2 // 2,
                   x.size(1), TOP_K=topk_ids.size(1), HAS_SCALE=w13_scale is not None, IEEE=x.dtype == torch.float32)
    return h


def down_sorted(h, w2, w2_scale, topk_weights, align, config: MoEConfig, out=None) -> torch.Tensor:
    """The sorted path's second GEMM: y [num_pairs, H] in h's dtype, each row times its pair's
    routing weight (the top-k sum is left to the caller)."""
    (num_pairs, k), (num_experts, hidden, _) = h.shape, w2.shape
    y = out if out is not None else torch.empty(num_pairs, hidden, dtype=h.dtype, device=h.device)
    _sorted_launch(moe_down_kernel, hidden, num_pairs, num_experts, config, h, w2, w2_scale, *align, topk_weights, y,
                   hidden, k, HAS_SCALE=w2_scale is not None, IEEE=h.dtype == torch.float32)
    return y


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
                  config: MoEConfig | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])) for e = topk_ids[t, j]:
    x [T, H] (bf16, fp16 or float32, contiguous); w13 [E, 2N, H], w2 [E, H, N] in x's dtype, or
    float8 e4m3 with w13_scale [E, 2N] and w2_scale [E, H] float32; topk_weights [T, k] float32,
    topk_ids [T, k] int32 (moe_routing.moe_topk's output). expert_map: with expert parallelism,
    [num_experts] int32, each id's expert in w13/w2 or -1 (another rank's: its pairs count 0).
    Returns [T, H] in x's dtype, written to out when given (rows may be strided: a
    tensor-parallel partial-sums buffer). config: the path and tiles (default_config(T, k,
    num_experts) when None)."""
    num_tokens, hidden = x.shape
    if expert_map is not None:
        topk_ids = expert_map[topk_ids]
    num_experts = w13.size(0) if expert_map is None else expert_map.numel()  # pairs per expert: of all experts
    config = config or default_config(num_tokens, topk_ids.size(1), num_experts)
    out = out if out is not None else torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    if config.pairs:
        h = gate_up_pairs(x, w13, w13_scale, topk_ids, config)
        return down_pairs(h, w2, w2_scale, topk_ids, topk_weights, out, config)
    align = moe_align_block_size(topk_ids, w13.size(0), config.block_m)
    h = gate_up_sorted(x, w13, w13_scale, topk_ids, align, config)
    skipped = None if expert_map is None else torch.zeros(topk_ids.numel(), hidden, dtype=x.dtype, device=x.device)
    y = down_sorted(h, w2, w2_scale, topk_weights, align, config, out=skipped)  # skipped pairs' rows stay 0
    return moe_sum(y, out)


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              out: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
              config: MoEConfig | None = None) -> torch.Tensor:
    """A mixture-of-experts layer's output from its router's logits: each token's top_k experts as
    moe_routing.moe_topk chooses them (renormalize: Qwen3-MoE's norm_topk_prob; Mixtral always),
    then fused_experts. router_logits [T, E] (any float dtype, rows may be strided; E all the
    experts, expert_map's length with expert parallelism); the rest as fused_experts. On the pair
    path the gate/up kernel chooses the experts itself: two launches where moe_topk made three."""
    num_tokens = x.size(0)
    config = config or default_config(num_tokens, top_k, router_logits.size(1))
    if not config.pairs or num_tokens == 0:
        weights, ids = moe_topk(router_logits, top_k, renormalize)
        return fused_experts(x, w13, w2, weights, ids, w13_scale, w2_scale, out, expert_map, config)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    out = out if out is not None else torch.empty_like(x)
    route = (router_logits, renormalize, weights, expert_map)
    h = gate_up_pairs(x.contiguous(), w13, w13_scale, ids, config, route=route)
    return down_pairs(h, w2, w2_scale, ids, weights, out, config)
