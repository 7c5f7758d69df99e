"""Tokens a row may not sample this step: EOS and stop_token_ids before min_tokens, and bad words
of one token."""
import torch

from nanovllm.sampling.processors.base import LogitsProcessor, StepBatch


class BannedTokens(LogitsProcessor):
    """State: (rows [B] int64, token ids [B] int64) whose logits become -inf."""

    def applies(self, params) -> bool:
        return params.min_tokens > 0 or bool(params.bad_words)

    def prepare(self, batch: StepBatch, rows: list[int]):
        banned = []
        for row in rows:
            seq = batch.seqs[row]
            p = seq.sampling_params
            banned += [(row, t) for w in seq.bad_words_ids if len(w) == 1 for t in w]
            if seq.num_completion_tokens < p.min_tokens:  # counts the PLACEHOLDER: the sampled token is the next
                banned += [(row, t) for t in (*(() if p.ignore_eos else self.eos_token_ids), *(p.stop_token_ids or ()))]
        if not banned:
            return None
        return batch.upload([r for r, _ in banned], torch.int64), batch.upload([t for _, t in banned], torch.int64)

    def apply(self, logits: torch.Tensor, state):
        logits[state] = float("-inf")
