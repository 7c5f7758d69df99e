"""LoRA's products for a step whose rows run different adapters, grouped by adapter as in Punica's
SGMV (Chen et al. 2023, arXiv 2310.18547): y[rows of slot l] += (x A_l^T) B_l^T for every
adapter slot l of the step in one launch.

A LoRA layer's weights (layers/lora.py): lora_a [max_loras, S * R, K], each slot's A of the
layer's S packed slices (q, k, v; gate, up; or one) stacked, R = max_lora_rank (an adapter of
lower rank padded with zero rows); lora_b [max_loras, N, R], each slot's B scaled by alpha / r
(zero columns past its rank), its rows the layer's N output features, slice s owning
[bounds[s], bounds[s + 1]). A step's mapping: rows [n] int32, the token rows that carry an
adapter, grouped by slot; tiles [num_tiles, 3] int32, (slot, start, end): rows[start:end], at
most BLOCK_M of one slot; slot -1 marks an unused tile (a CUDA graph's spare ones). A row in no
tile is neither read nor written, so rows without an adapter cost nothing.

x is the layer's input as its base product reads it (normed or gated already: layers/lora.py).
Punica's pair of kernels: lora_shrink (s = x A^T per tile, float32, K split over programs when
tiles are few) then lora_expand (y += s B^T per tile, slice and block of output columns).
Products in float32 (tensor cores for 16-bit inputs); the shrink's result rounded to the model
dtype before the expand, as PEFT rounds it.

Two launches per product from two rows on: one kernel that recomputes each tile's shrink for
every block of output columns it expands saves a launch but repeats the shrink's reads of x and A
per block, and was 2-3x slower from 1 to 256 rows (H100, Qwen3-0.6B's four products, rank 16,
benchmarks/lora_kernels.py: 89 against 32 us per layer at one row, 96 against 53 at 256). One
row (a decode step of one sequence) takes no launch of its own: the base product's kernel
computes the delta too (kernels/gemv.py's GemvLoRA), +4.6 us per layer on an H200.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_args, pdl_start


@triton.jit
def _tile(tiles_ptr, rows_ptr, tile, BLOCK_M: tl.constexpr):
    """Tile `tile`'s slot, its positions in rows [BLOCK_M], which of them are live, and their rows."""
    slot = tl.load(tiles_ptr + 3 * tile)
    start = tl.load(tiles_ptr + 3 * tile + 1)
    end = tl.load(tiles_ptr + 3 * tile + 2)
    pos = start + tl.arange(0, BLOCK_M)
    live = pos < end
    rows = tl.load(rows_ptr + pos, mask=live, other=0).to(tl.int64)
    return slot, pos, live, rows


# the adapter rows and the split of K change from step to step: kept out of Triton's specialisation
@triton.jit(do_not_specialize=["num_pos", "split_k"])
def lora_shrink_kernel(x_ptr, x_stride, a_ptr, rows_ptr, tiles_ptr, s_ptr, num_pos, K, SR, split_k,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                       PDL: tl.constexpr):
    """Grid (num_tiles, split_k): program (t, k) writes s[k, pos, :SR] (s: [split_k, num_pos, SR]
    float32) for tile t's positions: the k-th of split_k slices of K (whole BLOCK_K steps, none
    empty) of x A_slot^T, all of the slot's SR = S * R rows of A (K apart) at once."""
    tile, split = tl.program_id(0), tl.program_id(1)
    pdl_start(PDL)
    slot, pos, live, rows = _tile(tiles_ptr, rows_ptr, tile, BLOCK_M)
    if slot >= 0:
        k_len = tl.cdiv(tl.cdiv(K, split_k), BLOCK_K) * BLOCK_K
        k_lo = split * k_len
        k_hi = tl.minimum(K, k_lo + k_len)
        r = tl.arange(0, BLOCK_R)
        a_rows = a_ptr + slot.to(tl.int64) * SR * K + r[:, None] * K
        x_rows = x_ptr + rows[:, None] * x_stride
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            mask = live[:, None] & (cols[None, :] < k_hi)
            v = tl.load(x_rows + cols[None, :], mask=mask, other=0.0)
            a = tl.load(a_rows + cols[None, :], mask=(r[:, None] < SR) & (cols[None, :] < k_hi), other=0.0)
            acc = tl.dot(v, tl.trans(a), acc, input_precision=PRECISION)
        tl.store(s_ptr + (split * num_pos + pos[:, None]) * SR + r[None, :], acc,
                 mask=live[:, None] & (r[None, :] < SR))


@triton.jit(do_not_specialize=["num_pos", "split_k"])
def lora_expand_kernel(s_ptr, b_ptr, y_ptr, y_stride, rows_ptr, tiles_ptr, num_pos, N, S1, S2, R, SR, split_k,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                       PDL: tl.constexpr):
    """Grid (num_tiles, cdiv(widest slice, BLOCK_N), num_slices): program (t, j, sl) adds to tile
    t's rows of y their s (summed over the split_k partials, rounded to B's dtype) of slice sl
    times B's rows (R apart) of that slice's j-th block of BLOCK_N output columns; slices [0, S1),
    [S1, S2), [S2, N)."""
    tile, block, sl = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pdl_start(PDL)
    slot, pos, live, rows = _tile(tiles_ptr, rows_ptr, tile, BLOCK_M)
    first = tl.where(sl == 0, 0, tl.where(sl == 1, S1, S2)) + block * BLOCK_N
    hi = tl.where(sl == 0, S1, tl.where(sl == 1, S2, N))
    if (slot >= 0) & (first < hi):
        r = tl.arange(0, BLOCK_R)
        r_live = r < R
        s_ptrs = s_ptr + pos[:, None] * SR + sl * R + r[None, :]
        s_mask = live[:, None] & r_live[None, :]
        s = tl.load(s_ptrs, mask=s_mask, other=0.0)
        for k in range(1, split_k):
            s += tl.load(s_ptrs + k * num_pos * SR, mask=s_mask, other=0.0)
        cols = first + tl.arange(0, BLOCK_N)
        col_live = cols < hi
        b = tl.load(b_ptr + slot.to(tl.int64) * N * R + cols[None, :] * R + r[:, None],
                    mask=r_live[:, None] & col_live[None, :], other=0.0)
        delta = tl.dot(s.to(b.dtype), b, input_precision=PRECISION)
        ptrs = y_ptr + rows[:, None] * y_stride + cols[None, :]
        mask = live[:, None] & col_live[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


EXPAND_BLOCK_N = 64
MAX_SPLIT_K = 8
SPLIT_K_PROGRAMS = 128  # the shrink's programs that split_k_for fills up to


def _rank_block(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def split_k_for(k: int, block_k: int, num_tiles: int) -> int:
    """How many programs share each tile's K: until ~128 programs run (a decode step's few tiles
    alone would leave most SMs idle), at most MAX_SPLIT_K, each whole BLOCK_K steps and none
    without any (5 asked of 8 steps: 4 splits of 2, not a fifth that sums nothing). 128 rather
    than 64 programs: at 256 rows of 8 adapters (24 tiles) down_proj's shrink 23.7 -> 11.7 us, a
    layer's four shrinks and expands 48.8 -> 36.7 us (H100, Qwen3-0.6B; 256 programs: 37.6)."""
    steps = triton.cdiv(k, block_k)
    asked = max(1, min(MAX_SPLIT_K, steps, SPLIT_K_PROGRAMS // max(num_tiles, 1)))
    return triton.cdiv(steps, triton.cdiv(steps, asked))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, rows: torch.Tensor, tiles: torch.Tensor,
                block_m: int) -> torch.Tensor:
    """s = x A^T for every position of rows in a tile: [split_k, len(rows), S * R] float32, the
    split_k partial sums over K to be added (lora_expand adds them). x: [T, K] in lora_a's dtype
    (the layer's input: normed or gated already); lora_a [max_loras, S * R, K]; rows, tiles,
    block_m (tiles' most positions): the step's mapping (module docstring)."""
    assert x.stride(-1) == 1 and x.dtype == lora_a.dtype
    k, sr, num_tiles = lora_a.size(2), lora_a.size(1), tiles.size(0)
    assert x.size(1) == k
    fp32 = x.dtype == torch.float32  # float32 products on the CUDA cores, not in TF32
    block_k = 64 if fp32 else 128
    split_k = split_k_for(k, block_k, num_tiles)
    s = torch.empty(split_k, rows.numel(), sr, dtype=torch.float32, device=x.device)
    if num_tiles:
        lora_shrink_kernel[(num_tiles, split_k)](
            x, x.stride(0), lora_a, rows, tiles, s, rows.numel(), k, sr, split_k, BLOCK_M=block_m,
            BLOCK_R=_rank_block(sr), BLOCK_K=block_k, PRECISION="ieee" if fp32 else "tf32", num_warps=4,
            **pdl_args(x.device))
    return s


def lora_expand(y: torch.Tensor, s: torch.Tensor, lora_b: torch.Tensor, rows: torch.Tensor, tiles: torch.Tensor,
                block_m: int, bounds: tuple[int, ...]) -> torch.Tensor:
    """y[rows] += s B^T in place, slice by slice, and returns y. y: [T, N] (rows y.stride(0) apart);
    s: lora_shrink's; lora_b [max_loras, N, R]; bounds: (0, ..., N), the slices' first output
    columns and N (at most three slices)."""
    n, rank, slices = lora_b.size(1), lora_b.size(2), len(bounds) - 1
    assert y.stride(-1) == 1 and y.size(1) == n == bounds[-1] and 1 <= slices <= 3 and s.size(2) == slices * rank
    s1, s2 = (list(bounds[1:-1]) + [n, n])[:2]
    widest = max(b - a for a, b in zip(bounds, bounds[1:]))
    if tiles.size(0):
        fp32 = s.dtype == lora_b.dtype
        lora_expand_kernel[(tiles.size(0), triton.cdiv(widest, EXPAND_BLOCK_N), slices)](
            s, lora_b, y, y.stride(0), rows, tiles, rows.numel(), n, s1, s2, rank, s.size(2), s.size(0),
            BLOCK_M=block_m, BLOCK_R=_rank_block(rank), BLOCK_N=EXPAND_BLOCK_N, PRECISION="ieee" if fp32 else "tf32",
            num_warps=4, **pdl_args(y.device))
    return y
