"""Penalties (sampling/processors/penalties.py) in one pass over the penalised rows of the logits
on the GPU: each element reads its logit, its completion count and its prompt bit and is written
once, where torch writes a dozen [rows, vocab] float32 tensors."""
import torch
import triton
import triton.language as tl


@triton.jit
def penalty_kernel(logits_ptr, stride, rows_ptr, counts_ptr, prompt_mask_ptr, count_rows_ptr, presence_ptr,
                   frequency_ptr, repetition_ptr, vocab_size, HAS_PROMPT: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (R, cdiv(vocab, BLOCK)): the penalties of the i-th penalised row on one BLOCK of its row
    rows[i] of logits [N, vocab] float32 (rows `stride` apart), in place. Divisions round as
    torch's (div_rn)."""
    i, chunk = tl.program_id(0), tl.program_id(1)
    presence, frequency = tl.load(presence_ptr + i), tl.load(frequency_ptr + i)
    repetition = tl.load(repetition_ptr + i)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab_size
    source = tl.load(count_rows_ptr + i) * vocab_size
    row_ptr = logits_ptr + tl.load(rows_ptr + i) * stride
    x = tl.load(row_ptr + offs, mask=mask)
    count = tl.load(counts_ptr + source + offs, mask=mask, other=0).to(tl.float32)
    seen = count > 0
    if HAS_PROMPT:
        seen |= tl.load(prompt_mask_ptr + source + offs, mask=mask, other=0) != 0
    x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
    x -= frequency * count + presence * (count > 0).to(tl.float32)
    tl.store(row_ptr + offs, x, mask=mask)


def apply_penalties_kernel(logits: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor,
                           prompt_mask: torch.Tensor | None, count_rows: torch.Tensor, presence: torch.Tensor,
                           frequency: torch.Tensor, repetition: torch.Tensor):
    """Penalise rows [R] int64 of logits [N, vocab] float32 (CUDA, or Triton's interpreter), in
    place: row rows[i] with presence[i], frequency[i], repetition[i] (float32) over counts [C,
    vocab] int32 and, when given, prompt_mask [C, vocab] bool, at their row count_rows[i] (int64)."""
    vocab = logits.size(1)
    penalty_kernel[(rows.numel(), triton.cdiv(vocab, 4096))](
        logits, logits.stride(0), rows, counts, prompt_mask if prompt_mask is not None else counts, count_rows,
        presence, frequency, repetition, vocab, HAS_PROMPT=prompt_mask is not None, BLOCK=4096, num_warps=8)
