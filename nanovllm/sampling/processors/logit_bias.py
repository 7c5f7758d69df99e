"""logit_bias: a value added to the logits of given token ids."""
import torch

from nanovllm.sampling.processors.base import LogitsProcessor, StepBatch


class LogitBias(LogitsProcessor):
    """State: (rows [B] int64, token ids [B] int64, biases [B] float32), one entry per (row, token)."""

    def applies(self, params) -> bool:
        return bool(params.logit_bias)

    def prepare(self, batch: StepBatch, rows: list[int]):
        bias = [(row, t, b) for row in rows for t, b in batch.seqs[row].sampling_params.logit_bias.items()]
        return tuple(batch.upload([e[i] for e in bias], dtype)
                     for i, dtype in enumerate((torch.int64, torch.int64, torch.float32)))

    def apply(self, logits: torch.Tensor, state):
        rows, tokens, values = state
        logits.index_put_((rows, tokens), values, accumulate=True)
