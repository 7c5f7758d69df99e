"""A grammar's token bitmask on the logits (sampling/processors/grammar_bitmask.py): each masked
row's disallowed tokens set to -inf, in one pass that reads the bitmask and writes only them."""
import torch
import triton
import triton.language as tl

WORDS = 64  # bitmask words per program: 2,048 logits


@triton.jit
def token_bitmask_kernel(logits_ptr, stride, rows_ptr, bitmask_ptr, num_words, vocab_size, WORDS: tl.constexpr):
    """Grid (R, cdiv(vocab_size, 32 * WORDS)): row rows[i] of logits [N, vocab_size] (rows `stride`
    apart) keeps the tokens whose bit is set in row i of bitmask [R, num_words] int32 (bit b of
    word w: token 32 w + b); the others, and tokens past 32 * num_words, become -inf."""
    i, chunk = tl.program_id(0), tl.program_id(1)
    w = chunk * WORDS + tl.arange(0, WORDS)
    words = tl.load(bitmask_ptr + i * num_words + w, mask=w < num_words, other=0)
    bit = tl.arange(0, 32)
    banned = ((words[:, None] >> bit[None, :]) & 1) == 0  # the low bit after an arithmetic shift
    cols = w[:, None] * 32 + bit[None, :]
    row_ptr = logits_ptr + tl.load(rows_ptr + i) * stride
    tl.store(row_ptr + cols, float("-inf"), mask=banned & (cols < vocab_size))


def apply_token_bitmask_kernel(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor):
    """Mask rows [R] int64 of logits [N, vocab] (any float dtype, CUDA or Triton's interpreter) in
    place with bitmask [R, W] int32 (contiguous), as token_bitmask_kernel says."""
    vocab = logits.size(1)
    token_bitmask_kernel[(rows.numel(), triton.cdiv(vocab, 32 * WORDS))](
        logits, logits.stride(0), rows, bitmask, bitmask.size(1), vocab, WORDS=WORDS, num_warps=4)
