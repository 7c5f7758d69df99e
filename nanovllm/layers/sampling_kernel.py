"""One-pass sampling for rows that only scale by temperature: the Gumbel-max trick
(argmax(x / T + G), G = -log(-log(U)), U ~ Uniform(0, 1), draws exactly from softmax(x / T);
Gumbel 1954, as used by e.g. Kool et al. 2019). The noise comes from Triton's Philox tl.rand, so
the logits are read once and nothing of vocabulary size is written."""
import torch
import triton
import triton.language as tl


@triton.jit
def gumbel_max_kernel(logits_ptr, stride, temperatures_ptr, seeds_ptr, max_ptr, index_ptr, vocab_size,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (num_rows, num_chunks): the max over one CHUNK of the vocabulary of logits / T + Gumbel
    noise (logits where T == 0) and its first index, written to max/index [num_rows, num_chunks]."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    seed = tl.load(seeds_ptr + row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32)
    for start in range(chunk * CHUNK, tl.minimum(vocab_size, (chunk + 1) * CHUNK), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        if temperature > 0:
            u = tl.rand(seed, offs)
            x = x / temperature - tl.log(-tl.log(u))
        take = x > best
        best = tl.where(take, x, best)
        best_index = tl.where(take, offs, best_index)
    top = tl.max(best, 0)
    out = row * tl.num_programs(1) + chunk
    tl.store(max_ptr + out, top)
    tl.store(index_ptr + out, tl.min(tl.where(best == top, best_index, vocab_size), 0).to(tl.int64))


CHUNK = 8192  # vocabulary entries per program: 19 programs per row for Qwen's 151,936


def gumbel_max_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """logits [N, vocab] (any float dtype), temperatures [N] float32, seeds [N] int32 -> token ids [N] int64."""
    rows, chunks = logits.size(0), triton.cdiv(logits.size(1), CHUNK)
    maxima = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    gumbel_max_kernel[(rows, chunks)](logits, logits.stride(0), temperatures, seeds, maxima, indices, logits.size(1),
                                      CHUNK=CHUNK, BLOCK=2048, num_warps=4)
    return indices.gather(1, maxima.argmax(1, keepdim=True)).squeeze(1)  # first chunk on ties
