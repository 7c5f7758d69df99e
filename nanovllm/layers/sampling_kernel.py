"""One-pass sampling for rows that only scale by temperature: the Gumbel-max trick
(argmax(x / T + G), G = -log(-log(U)), U ~ Uniform(0, 1), draws exactly from softmax(x / T);
Gumbel 1954, as used by e.g. Kool et al. 2019). The noise comes from Triton's Philox tl.rand, so
the logits are read once and nothing of vocabulary size is written."""
import torch
import triton
import triton.language as tl


@triton.jit
def gumbel_max_kernel(logits_ptr, stride, temperatures_ptr, seeds_ptr, max_ptr, index_ptr, vocab_size,
                      CHUNK: tl.constexpr, SUB: tl.constexpr):
    """Grid (num_rows, num_chunks): the max over one CHUNK of the vocabulary of logits / T + Gumbel
    noise (logits where T == 0) and its first index, written to max/index [num_rows, num_chunks].
    Works in base 2 (a positive scale and a constant shift leave the argmax unchanged):
    x * log2(e) / T - log2(-log2(U)); one Philox call gives the uniforms of 4 sub-tiles."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    seed = tl.load(seeds_ptr + row)
    scale = 1.4426950408889634 / tl.where(temperature > 0, temperature, 1.0)
    best = tl.full([SUB], float("-inf"), tl.float32)
    best_index = tl.zeros([SUB], tl.int32)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    for start in range(chunk * CHUNK, tl.minimum(vocab_size, (chunk + 1) * CHUNK), 4 * SUB):
        base = start + tl.arange(0, SUB)
        u0, u1, u2, u3 = tl.rand4x(seed, base)
        best, best_index = _fold(row_ptr, base, u0, scale, temperature, vocab_size, best, best_index)
        best, best_index = _fold(row_ptr, base + SUB, u1, scale, temperature, vocab_size, best, best_index)
        best, best_index = _fold(row_ptr, base + 2 * SUB, u2, scale, temperature, vocab_size, best, best_index)
        best, best_index = _fold(row_ptr, base + 3 * SUB, u3, scale, temperature, vocab_size, best, best_index)
    top = tl.max(best, 0)
    out = row * tl.num_programs(1) + chunk
    tl.store(max_ptr + out, top)
    tl.store(index_ptr + out, tl.min(tl.where(best == top, best_index, vocab_size), 0).to(tl.int64))


@triton.jit
def _fold(row_ptr, offs, u, scale, temperature, vocab_size, best, best_index):
    x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32) * scale
    if temperature > 0:
        x = x - tl.log2(-tl.log2(u))
    take = x > best
    return tl.where(take, x, best), tl.where(take, offs, best_index)


CHUNK = 8192  # vocabulary entries per program: 19 programs per row for Qwen's 151,936


def gumbel_max_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """logits [N, vocab] (any float dtype), temperatures [N] float32, seeds [N] int32 -> token ids [N] int64."""
    rows, chunks = logits.size(0), triton.cdiv(logits.size(1), CHUNK)
    maxima = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    gumbel_max_kernel[(rows, chunks)](logits, logits.stride(0), temperatures, seeds, maxima, indices, logits.size(1),
                                      CHUNK=CHUNK, SUB=512, num_warps=4)
    return indices.gather(1, maxima.argmax(1, keepdim=True)).squeeze(1)  # first chunk on ties
