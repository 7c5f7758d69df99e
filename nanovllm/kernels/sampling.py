"""One pass over rows of logits on the GPU. Sampling for rows that only scale by temperature:
the Gumbel-max trick (argmax(x / T + G), G = -log(-log(U)), U ~ Uniform(0, 1), draws exactly from softmax(x / T);
Gumbel 1954, as used by e.g. Kool et al. 2019). The logits are read once and nothing of
vocabulary size is written. The uniforms come from a counter-based hash (MurmurHash3's 32-bit
finaliser over the row's seed and the token index): Philox (tl.rand) made the kernel ALU-bound,
130 us for 256 x 151,936 logits on an H200. Logprobs: each row's logsumexp and the rank of its
token, without writing a log-softmax of vocabulary size. Top k (k <= 64): each chunk's entries
above a per-row threshold, then torch.topk over those candidates alone (chunked_topk). Top p
and min p: the Gumbel-max draw over the tokens above a rising pivot (nucleus_sample); with top
k, the filters and the draw over the top k in one kernel (topk_sample)."""
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

HARDWARE_LOG2 = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")  # on a GPU, not in the CPU interpreter


@triton.jit
def gumbel_max_kernel(logits_ptr, stride, temperatures_ptr, seeds_ptr, max_ptr, index_ptr, max_y_ptr, vocab_size,
                      offset, MAX_Y: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr):
    """Grid (num_rows, num_chunks): the max over one CHUNK of the row's first vocab_size logits of
    logits / T + Gumbel noise (logits where T == 0) and its first token id, written to max/index
    [num_rows, num_chunks]; column c holds token offset + c (a tensor-parallel rank's vocabulary
    shard), whose noise it draws. Works in base 2 (a positive scale and a constant shift leave the
    argmax unchanged): x * log2(e) / T - log2(-log2(U)). MAX_Y: also the chunk's largest x * log2(e) / T
    (to max_y), for the nucleus draw."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    seed = _fmix32(tl.load(seeds_ptr + row).to(tl.uint32))
    scale = 1.4426950408889634 / tl.where(temperature > 0, temperature, 1.0)
    best = tl.full([SUB], float("-inf"), tl.float32)
    best_index = tl.zeros([SUB], tl.int32)
    max_y = tl.full([SUB], float("-inf"), tl.float32)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    for start in range(chunk * CHUNK, tl.minimum(vocab_size, (chunk + 1) * CHUNK), SUB):
        offs = start + tl.arange(0, SUB)
        x = _scaled_logits(row_ptr, offs, vocab_size, scale)
        if MAX_Y:
            max_y = tl.maximum(max_y, x)
        if temperature > 0:
            x = x + _gumbel2(offs + offset, seed)
        take = x > best
        best = tl.where(take, x, best)
        best_index = tl.where(take, offs, best_index)
    top = tl.max(best, 0)
    out = row * tl.num_programs(1) + chunk
    tl.store(max_ptr + out, top)
    tl.store(index_ptr + out, tl.min(tl.where(best == top, best_index, vocab_size), 0).to(tl.int64) + offset)
    if MAX_Y:
        tl.store(max_y_ptr + out, tl.max(max_y, 0))


@triton.jit
def _gumbel2(offs, seed):
    """Gumbel noise in base 2 at token ids offs for a row's hashed seed: U from 23 bits of the hash
    of (token id, seed), in (0, 1) exactly in float32 (gumbel_noise in torch)."""
    return gumbel2_at((_fmix32(offs.to(tl.uint32) * 0x9E3779B9 + seed) >> 9).to(tl.float32))


@triton.jit
def gumbel2_at(k):
    """-log2(-log2(U)) at U = (k + 0.5) / 2^23, k float32 integers in [0, 2^23): within 8e-6 of
    the exact value on the GPU by the hardware log2's bounds (tests/test_sampler.py checks every k
    against float64); 1.05e-6 at most in the interpreter (float32 itself: the noise reaches 23.5,
    whose ulp is 1.9e-6)."""
    C1: tl.constexpr = 1.4426950408889634  # 1 / ln 2
    # E = -log2(U) needs a small relative error, which the hardware's log2 (an absolute error of
    # up to 2^-22 near 1) gives only away from U = 1; near it, the series -log2(1 - V) =
    # (V + V^2/2 + ...) / ln 2 in V = 1 - U, which the grid (k + 0.5) / 2^23 gives exactly (six
    # terms: below 1e-8 of E for V < 1/16). -log2(E) needs only a small absolute error.
    v = (1 - 0.5 / 8388608) - k * (1.0 / 8388608)
    series = v * (C1 + v * (C1 / 2 + v * (C1 / 3 + v * (C1 / 4 + v * (C1 / 5 + v * (C1 / 6))))))
    e = tl.where(v < 0.0625, series, -_log2(k * (1.0 / 8388608) + 0.5 / 8388608))
    return -_log2(e)


@triton.jit
def _log2(x):
    """log2(x), float32: the GPU's lg2.approx (one MUFU.LG2; ~8x fewer instructions than the
    precise log2, which made the Gumbel-max kernel ALU-bound); tl.log2 in Triton's interpreter."""
    if HARDWARE_LOG2:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def _scaled_logits(row_ptr, offs, vocab_size, scale):
    """A row's logits at offs in float32 times scale, -inf past vocab_size."""
    return tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32) * scale


@triton.jit
def _fmix32(h):
    """MurmurHash3's 32-bit finaliser (Appleby 2011): a bijection whose output bits all depend on every input bit."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


CHUNK = 8192  # vocabulary entries per program: 19 programs per row for Qwen's 151,936
MAX_KERNEL_TOPK = 64  # the largest k of logits_stats.chunked_topk; topk_sample pads every k up to it alike


def gumbel_max_candidates(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, offset: int = 0,
                          width: int | None = None,
                          max_y: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each CHUNK's best of logits [N, W] (any float dtype; column c is token offset + c, the
    first `width` columns real): (maxima [N, cdiv(W, CHUNK)] float32 of x / T + G in base 2, or
    of x where T == 0; their token ids, int64, the first on ties). temperatures [N] float32, seeds
    [N] int32. A chunk with no real column gives -inf. max_y: written with each chunk's largest
    x / T in base 2 (x where T == 0), if given ([N, cdiv(W, CHUNK)] float32)."""
    rows, chunks = logits.size(0), triton.cdiv(logits.size(1), CHUNK)
    maxima = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    gumbel_max_kernel[(rows, chunks)](logits, logits.stride(0), temperatures, seeds, maxima, indices,
                                      maxima if max_y is None else max_y, logits.size(1) if width is None else width,
                                      offset, MAX_Y=max_y is not None, CHUNK=CHUNK, SUB=1024, num_warps=4)
    return maxima, indices


def gumbel_max_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """logits [N, vocab] (any float dtype), temperatures [N] float32, seeds [N] int32 -> token ids [N] int64."""
    maxima, ids = gumbel_max_candidates(logits, temperatures, seeds)
    return ids.gather(1, maxima.argmax(1, keepdim=True)).squeeze(1)  # the first maximum, as argmax


@triton.jit
def nucleus_sample_kernel(logits_ptr, stride, temperatures_ptr, top_p_ptr, min_p_ptr, seeds_ptr, cand_ptr,
                          cand_index_ptr, max_y_ptr, out_ptr, vocab_size, num_chunks, CHUNKS: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Grid (num_rows,): one token per row from softmax(x / T) restricted to min_p's and top_p's
    set N (logits where T == 0), with no sort of the vocabulary. The draw is the Gumbel-max
    argmax over N of x / T + G, G the noise of gumbel_max_kernel (so a seeded row draws the
    sorted path's token): take the argmax over the tokens above a pivot; if the tokens more
    probable than it already hold top_p of the mass, it is outside N, and the pivot rises to it.
    Every token of N stays above the pivot, so the first argmax inside N is the argmax over N;
    the most probable token is in N, so the loop ends, after at most 1 / top_p rounds on
    average (the argmax falls in N with probability mass(N) >= top_p; FlashInfer's rejection
    sampling has the same bound). N: min_p keeps p >= min_p * p_max, then top_p keeps the tokens
    whose more probable tokens (of those) hold less than top_p. Base 2 as gumbel_max_kernel.
    The first round's argmax over the whole row, and the row's largest x / T, come from
    gumbel_max_kernel's num_chunks (<= CHUNKS) chunk candidates cand, cand_index and max_y
    [num_rows, num_chunks], which many programs per row compute; if that argmax is below min_p's
    floor, the first round is redone here with the floor."""
    row = tl.program_id(0)
    temperature, top_p, min_p = tl.load(temperatures_ptr + row), tl.load(top_p_ptr + row), tl.load(min_p_ptr + row)
    seed = _fmix32(tl.load(seeds_ptr + row).to(tl.uint32))
    scale = 1.4426950408889634 / tl.where(temperature > 0, temperature, 1.0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    offs_c = row * num_chunks + tl.arange(0, CHUNKS)
    chunk_mask = tl.arange(0, CHUNKS) < num_chunks
    top = tl.max(tl.load(max_y_ptr + offs_c, mask=chunk_mask, other=float("-inf")), 0)
    cand = tl.load(cand_ptr + offs_c, mask=chunk_mask, other=float("-inf"))
    choice = tl.min(tl.where(cand == tl.max(cand, 0), tl.load(cand_index_ptr + offs_c, mask=chunk_mask, other=0),
                             vocab_size), 0).to(tl.int32)
    pivot = tl.load(row_ptr + choice).to(tl.float32) * scale
    floor = tl.where(min_p > 0, top + tl.log2(tl.maximum(min_p, 1e-30)), float("-inf"))  # p / p_max >= min_p
    total = tl.zeros([BLOCK], tl.float32)
    above = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        y = _scaled_logits(row_ptr, offs, vocab_size, scale)
        p = tl.where(y >= floor, tl.exp2(y - top), 0.0)
        total += p
        above += tl.where(y > pivot, p, 0.0)
    total = tl.sum(total, 0)
    accepted = ((pivot >= floor) & ((top_p >= 1.0) | (tl.sum(above, 0) < top_p * total))).to(tl.int32)
    pivot = tl.where(pivot >= floor, pivot, float("-inf"))  # below the floor: the first round again, in N
    while accepted == 0:
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_index = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab_size, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            y = _scaled_logits(row_ptr, offs, vocab_size, scale)
            v = y
            if temperature > 0:
                v = y + _gumbel2(offs, seed)
            v = tl.where((y >= floor) & (y > pivot), v, float("-inf"))
            take = v > best
            best = tl.where(take, v, best)
            best_index = tl.where(take, offs, best_index)
        choice = tl.min(tl.where(best == tl.max(best, 0), best_index, vocab_size), 0)
        pivot = tl.load(row_ptr + choice).to(tl.float32) * scale
        accepted = 1
        if top_p < 1.0:
            above = tl.zeros([BLOCK], tl.float32)
            for start in range(0, vocab_size, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                y = _scaled_logits(row_ptr, offs, vocab_size, scale)
                above += tl.where((y >= floor) & (y > pivot), tl.exp2(y - top), 0.0)
            accepted = (tl.sum(above, 0) < top_p * total).to(tl.int32)
    tl.store(out_ptr + row, choice.to(tl.int64))


def nucleus_sample(logits: torch.Tensor, temperatures: torch.Tensor, top_p: torch.Tensor | None,
                   min_p: torch.Tensor | None, seeds: torch.Tensor) -> torch.Tensor:
    """logits [N, vocab] (any float dtype), temperatures [N] float32 (0: argmax), top_p and min_p
    [N] float32 or None (off), seeds [N] int32 -> token ids [N] int64, drawn from min_p's and
    top_p's set as Sampler's sorted path draws (nucleus_sample_kernel). The first round's argmax
    comes from the Gumbel-max kernel's chunks (19 programs a row); then one program per row reads
    the logits once, plus twice per further round."""
    rows = logits.size(0)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    top_p = top_p if top_p is not None else torch.ones(rows, device=logits.device)
    min_p = min_p if min_p is not None else torch.zeros(rows, device=logits.device)
    max_y = torch.empty(rows, triton.cdiv(logits.size(1), CHUNK), dtype=torch.float32, device=logits.device)
    cand, cand_index = gumbel_max_candidates(logits, temperatures, seeds, max_y=max_y)
    nucleus_sample_kernel[(rows,)](logits, logits.stride(0), temperatures, top_p, min_p, seeds, cand, cand_index, max_y,
                                   out, logits.size(1), max_y.size(1), CHUNKS=triton.next_power_of_2(max_y.size(1)),
                                   BLOCK=4096, num_warps=8)
    return out


@triton.jit(do_not_specialize=["K"])
def topk_sample_kernel(values_ptr, ids_ptr, temperatures_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, out_ptr,
                       K, K_PAD: tl.constexpr):
    """Grid (num_rows,): one token per row from the row's K (<= K_PAD) largest logits (values [N, K]
    float32, descending, with their token ids [N, K]), filtered as Sampler._filter_sorted filters them:
    min_p (p >= min_p * p_max), top_k (the first top_k; 0: all K), top_p (keep while the mass
    before an entry, of those left, is below top_p). Then the Gumbel-max argmax of x / T + G at
    the kept entries, G the noise of gumbel_max_kernel at their token ids (so a seeded row draws
    the sorted path's token); where T == 0 the smallest token id among the maxima (the argmax).
    Base 2 as gumbel_max_kernel. K is a runtime value (not specialised on): one compiled kernel
    per K_PAD serves every K up to it."""
    row = tl.program_id(0)
    rank = tl.arange(0, K_PAD)
    x = tl.load(values_ptr + row * K + rank, mask=rank < K, other=float("-inf"))
    ids = tl.load(ids_ptr + row * K + rank, mask=rank < K, other=0)
    temperature = tl.load(temperatures_ptr + row)
    if temperature > 0:
        x = x * (1.4426950408889634 / temperature)
        top_k, top_p, min_p = tl.load(top_k_ptr + row), tl.load(top_p_ptr + row), tl.load(min_p_ptr + row)
        top = tl.max(x, 0)
        keep = (rank < tl.where(top_k > 0, top_k, K)) & (x > float("-inf"))
        keep &= x >= tl.where(min_p > 0, top + tl.log2(tl.maximum(min_p, 1e-30)), float("-inf"))
        p = tl.where(keep, tl.exp2(x - top), 0.0)
        keep &= tl.cumsum(p, 0) - p < top_p * tl.sum(p, 0)
        v = tl.where(keep, x + _gumbel2(ids, _fmix32(tl.load(seeds_ptr + row).to(tl.uint32))), float("-inf"))
        choice = tl.min(tl.where(v == tl.max(v, 0), rank, K_PAD), 0)
        token = tl.sum(tl.where(rank == choice, ids, 0), 0)
    else:
        token = tl.min(tl.where(x == tl.max(x, 0), ids, 2**62), 0)
    tl.store(out_ptr + row, token)


def topk_sample(values: torch.Tensor, ids: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, min_p: torch.Tensor | None, seeds: torch.Tensor) -> torch.Tensor:
    """values [N, K] float32 (each row's K largest logits, descending), ids [N, K] int64 (their
    token ids), temperatures [N] float32 (0: argmax), top_k [N] int64 (0: off), top_p and min_p
    [N] float32 (each None: off), seeds [N] int32 -> token ids [N] int64, the token that
    Sampler's sorted path draws when every sampling row's top_k <= K (topk_sample_kernel): the
    filters and the draw in one kernel over [N, K], not a dozen torch kernels."""
    rows, k = values.shape
    out = torch.empty(rows, dtype=torch.int64, device=values.device)
    top_k = top_k if top_k is not None else torch.zeros(rows, dtype=torch.int64, device=values.device)
    top_p = top_p if top_p is not None else torch.ones(rows, device=values.device)
    min_p = min_p if min_p is not None else torch.zeros(rows, device=values.device)
    # one K_PAD for every k <= MAX_KERNEL_TOPK: one kernel, which the engine compiles at start-up
    topk_sample_kernel[(rows,)](values.contiguous(), ids.contiguous(), temperatures, top_k, top_p, min_p, seeds, out,
                                k, K_PAD=max(MAX_KERNEL_TOPK, triton.next_power_of_2(k)), num_warps=1)
    return out
