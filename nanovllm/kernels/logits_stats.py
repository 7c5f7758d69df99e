"""Reductions over rows of logits on the GPU, each reading the logits once and writing nothing of
vocabulary size: the logsumexp and the rank of a chosen token (logprobs), and the top k
(k <= MAX_KERNEL_TOPK) by each chunk's entries above a per-row threshold, then torch.topk over
those candidates alone."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.sampling import CHUNK, MAX_KERNEL_TOPK


@triton.jit
def logsumexp_rank_kernel(logits_ptr, stride, token_ids_ptr, max_ptr, sum_ptr, count_ptr, vocab_size,
                          CHUNK: tl.constexpr, SUB: tl.constexpr):
    """Grid (num_rows, num_chunks): over one CHUNK of a row of logits, the max m, sum(exp(x - m))
    and the count of entries above the logit of the row's token, written to [num_rows, num_chunks]
    (an online softmax: Milakov & Gimelshein 2018)."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    chosen = tl.load(row_ptr + tl.load(token_ids_ptr + row)).to(tl.float32)
    m = tl.full([SUB], float("-inf"), tl.float32)
    s = tl.zeros([SUB], tl.float32)
    count = tl.zeros([SUB], tl.int32)
    for start in range(chunk * CHUNK, tl.minimum(vocab_size, (chunk + 1) * CHUNK), SUB):
        offs = start + tl.arange(0, SUB)
        x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        new = tl.maximum(m, x)
        base = tl.where(new == float("-inf"), 0.0, new)  # no -inf - -inf where a lane has seen only -inf
        s = s * tl.exp(m - base) + tl.exp(x - base)
        m = new
        count += (x > chosen).to(tl.int32)
    top = tl.max(m, 0)
    out = row * tl.num_programs(1) + chunk
    tl.store(max_ptr + out, top)
    tl.store(sum_ptr + out, tl.sum(s * tl.exp(m - tl.where(top == float("-inf"), 0.0, top)), 0))
    tl.store(count_ptr + out, tl.sum(count, 0))


def logsumexp_and_rank(logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, vocab] (any float dtype), token_ids [N] int64 -> (logsumexp of each row in float32 [N],
    rank [N] int64 of each row's token: 1 + the entries above it), in one read of the logits."""
    rows, chunks = logits.size(0), triton.cdiv(logits.size(1), CHUNK)
    maxima = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    sums = torch.empty_like(maxima)
    counts = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    logsumexp_rank_kernel[(rows, chunks)](logits, logits.stride(0), token_ids, maxima, sums, counts, logits.size(1),
                                          CHUNK=CHUNK, SUB=1024, num_warps=4)
    top = maxima.amax(1, keepdim=True)
    return (top + (sums * (maxima - top).exp()).sum(1, keepdim=True).log()).squeeze(1), counts.sum(1) + 1


@triton.jit
def chunk_max_kernel(logits_ptr, stride, max_ptr, vocab_size, CHUNK: tl.constexpr):
    """Grid (num_rows, num_chunks): the max of one CHUNK of a row of logits, to max [num_rows, num_chunks]."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + offs, mask=offs < vocab_size, other=float("-inf"))
    tl.store(max_ptr + row * tl.num_programs(1) + chunk, tl.max(x.to(tl.float32), 0))


@triton.jit(do_not_specialize=["K"])
def chunk_topk_kernel(logits_ptr, stride, threshold_ptr, values_ptr, index_ptr, vocab_size, K,
                      K_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Grid (num_rows, num_chunks): the largest entries of one CHUNK of a row of logits that are at
    least the row's threshold, at most K (<= K_PAD), in descending order (the first index among
    equal values), written to values/index [num_rows, num_chunks * K]; the other slots get -inf.
    Rounds of max and remove over the chunk held in registers. A -inf logit becomes -FLT_MAX, so
    that the second stage prefers it to an empty slot. K is a runtime value (not specialised on),
    so one compiled kernel serves every k: the engine's start-up compiles it (sampling/warmup.py)."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < vocab_size
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + offs, mask=valid, other=float("-inf")).to(tl.float32)
    x = tl.where(valid, tl.maximum(x, -3.4028234663852886e38), float("-inf"))
    threshold = tl.load(threshold_ptr + row)
    out = (row * tl.num_programs(1) + chunk) * K
    top = tl.max(x, 0)
    i = 0
    while (i < K) & (top >= threshold):
        index = tl.min(tl.where(x == top, offs, 2147483647), 0)
        tl.store(values_ptr + out + i, top)
        tl.store(index_ptr + out + i, index.to(tl.int64))
        x = tl.where(offs == index, float("-inf"), x)  # once only -inf is left, what it stores stays -inf
        top = tl.max(x, 0)
        i += 1
    rest = tl.arange(0, K_PAD)
    tl.store(values_ptr + out + rest, float("-inf"), mask=(rest >= i) & (rest < K))
    tl.store(index_ptr + out + rest, 0, mask=(rest >= i) & (rest < K))


TOPK_CHUNK = 2048


def chunked_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(logits, k) for logits [N, vocab] (any float dtype), 1 <= k <= min(vocab, MAX_KERNEL_TOPK):
    (values [N, k] float32, descending; token ids [N, k] int64). Ties may come in any order, as
    torch.topk's. Raises ValueError for k outside that range.

    Three stages: each chunk's max; the row's threshold, the k-th largest of those maxima (at
    least k entries reach it, so the top k all do); each chunk's entries at or above the
    threshold, at most k (on real logits a handful per row, so few rounds); torch.topk over
    those candidates alone."""
    rows, vocab = logits.shape
    if not 1 <= k <= min(vocab, MAX_KERNEL_TOPK):
        raise ValueError(f"chunked_topk: k={k}, allowed 1..{min(vocab, MAX_KERNEL_TOPK)}")
    chunks = triton.cdiv(vocab, TOPK_CHUNK)
    maxima = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    chunk_max_kernel[(rows, chunks)](logits, logits.stride(0), maxima, vocab, CHUNK=TOPK_CHUNK, num_warps=4)
    threshold = maxima.topk(k, dim=-1).values[:, -1].contiguous() if k <= chunks \
        else torch.full((rows,), float("-inf"), device=logits.device)
    values = torch.empty(rows, chunks * k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, chunks * k, dtype=torch.int64, device=logits.device)
    chunk_topk_kernel[(rows, chunks)](logits, logits.stride(0), threshold, values, indices, vocab, k,
                                      K_PAD=MAX_KERNEL_TOPK, CHUNK=TOPK_CHUNK, num_warps=4)
    top, where = values.topk(k, dim=-1)
    return top.masked_fill_(top == torch.finfo(torch.float32).min, float("-inf")), indices.gather(1, where)
