"""allowed_token_ids: the only tokens a row may sample."""
import torch

from nanovllm.sampling.processors.base import LogitsProcessor, StepBatch


class AllowedTokenIds(LogitsProcessor):
    """State: (rows [A] int64, index [K] int64 into rows, token ids [K] int64): every logit of those
    rows becomes -inf but at their allowed tokens."""

    def applies(self, params) -> bool:
        return params.allowed_token_ids is not None

    def prepare(self, batch: StepBatch, rows: list[int]):
        allowed = [(i, t) for i, row in enumerate(rows) for t in batch.seqs[row].sampling_params.allowed_token_ids]
        return (batch.upload(rows, torch.int64), batch.upload([i for i, _ in allowed], torch.int64),
                batch.upload([t for _, t in allowed], torch.int64))

    def apply(self, logits: torch.Tensor, state):
        rows, index, tokens = state
        mask = torch.ones(rows.numel(), logits.size(1), dtype=torch.bool, device=logits.device)
        mask[index, tokens] = False
        logits[rows] = logits[rows].masked_fill(mask, float("-inf"))
