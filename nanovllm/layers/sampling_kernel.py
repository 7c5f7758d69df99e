"""One-pass sampling for rows that only scale by temperature: the Gumbel-max trick
(argmax(x / T + G), G = -log(-log(U)), U ~ Uniform(0, 1), draws exactly from softmax(x / T);
Gumbel 1954, as used by e.g. Kool et al. 2019). The noise comes from Triton's Philox tl.rand, so
the logits are read once and nothing of vocabulary size is written."""
import torch
import triton
import triton.language as tl


@triton.jit
def gumbel_max_kernel(logits_ptr, stride, temperatures_ptr, seeds_ptr, out_ptr, vocab_size, BLOCK: tl.constexpr):
    """Grid (num_rows,): out[row] = argmax over the vocabulary of logits / T + Gumbel noise
    (plain argmax, first index on ties, where T == 0)."""
    row = tl.program_id(0)
    temperature = tl.load(temperatures_ptr + row)
    seed = tl.load(seeds_ptr + row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        if temperature > 0:
            u = tl.rand(seed, offs)
            x = x / temperature - tl.log(-tl.log(u))
        take = x > best
        best = tl.where(take, x, best)
        best_index = tl.where(take, offs, best_index)
    top = tl.max(best, 0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_index, vocab_size), 0).to(tl.int64))


def gumbel_max_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """logits [N, vocab] (any float dtype), temperatures [N] float32, seeds [N] int32 -> token ids [N] int64."""
    out = torch.empty(logits.size(0), dtype=torch.int64, device=logits.device)
    gumbel_max_kernel[(logits.size(0),)](logits, logits.stride(0), temperatures, seeds, out, logits.size(1),
                                         BLOCK=4096, num_warps=8)
    return out
