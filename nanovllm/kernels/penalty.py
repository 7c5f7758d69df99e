"""Penalties (logits_processors.apply_penalties) in one pass over the logits on the GPU: each
element reads its logit, its completion count and its prompt bit and is written once, where torch
writes a dozen [rows, vocab] float32 tensors."""
import torch
import triton
import triton.language as tl


@triton.jit
def penalty_kernel(logits_ptr, stride, counts_ptr, prompt_mask_ptr, count_rows_ptr, presence_ptr, frequency_ptr,
                   repetition_ptr, vocab_size, HAS_PROMPT: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (num_rows, cdiv(vocab, BLOCK)): apply_penalties on one BLOCK of a row of logits
    [num_rows, vocab] float32 (rows `stride` apart), in place; rows without penalties are left
    alone. Divisions round as torch's (div_rn)."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    presence, frequency = tl.load(presence_ptr + row), tl.load(frequency_ptr + row)
    repetition = tl.load(repetition_ptr + row)
    if (presence != 0) | (frequency != 0) | (repetition != 1):
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < vocab_size
        source = tl.load(count_rows_ptr + row) * vocab_size
        x = tl.load(logits_ptr + row * stride + offs, mask=mask)
        count = tl.load(counts_ptr + source + offs, mask=mask, other=0).to(tl.float32)
        seen = count > 0
        if HAS_PROMPT:
            seen |= tl.load(prompt_mask_ptr + source + offs, mask=mask, other=0) != 0
        x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
        x -= frequency * count + presence * (count > 0).to(tl.float32)
        tl.store(logits_ptr + row * stride + offs, x, mask=mask)


def apply_penalties_kernel(logits: torch.Tensor, st):
    """apply_penalties for logits [N, vocab] float32 on CUDA (or Triton's interpreter), in place."""
    rows, vocab = logits.shape
    presence, frequency, repetition = st.penalties
    prompt_mask = st.prompt_mask if st.prompt_mask is not None else st.token_counts
    penalty_kernel[(rows, triton.cdiv(vocab, 4096))](
        logits, logits.stride(0), st.token_counts, prompt_mask, st.count_rows, presence, frequency, repetition, vocab,
        HAS_PROMPT=st.prompt_mask is not None, BLOCK=4096, num_warps=8)
