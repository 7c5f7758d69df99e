"""bad_words of several tokens: the word's last token is banned where the completion ends with the
rest of it (one-token words are BannedTokens')."""
import numpy as np
import torch

from nanovllm.sampling.processors.base import LogitsProcessor, StepBatch
from nanovllm.sequence import PLACEHOLDER


def _padded(rows: list[list[int]], pad: int, width: int = 0) -> np.ndarray:
    """Right-aligned rows in a [len(rows), max(width, longest)] array padded on the left with pad."""
    out = np.full((len(rows), max([width, *map(len, rows)])), pad, np.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, out.shape[1] - len(r):] = r
    return out


class BadWords(LogitsProcessor):
    """State: (rows [B] int64 of the logits, tails [U, M] int64: the last M completion tokens of
    each of the U sequences with such words, padded on the left with vocab_size; index [B] int64
    into tails; prefixes [B, M] int64, padded on the left with -3 (matches anything); token ids [B]
    int64), one entry per word."""

    def applies(self, params) -> bool:
        return bool(params.bad_words)

    def prepare(self, batch: StepBatch, rows: list[int]):
        rows = [row for row in rows if any(len(w) > 1 for w in batch.seqs[row].bad_words_ids)]
        words = [(i, row, w) for i, row in enumerate(rows) for w in batch.seqs[row].bad_words_ids if len(w) > 1]
        if not words:
            return None
        seqs = [batch.seqs[row] for row in rows]
        width = max(len(w) for _, _, w in words) - 1
        tails = batch.upload(_padded([seq.completion_token_ids[-width:] for seq in seqs], self.vocab_size, width),
                             torch.int64)
        pending = [i for i, seq in enumerate(seqs) if seq.num_completion_tokens and seq.token_ids[-1] == PLACEHOLDER]
        if pending:
            tails[batch.upload(pending, torch.int64), -1] = batch.last_sampled([seqs[i] for i in pending])
        return (batch.upload([row for _, row, _ in words], torch.int64), tails,
                batch.upload([i for i, _, _ in words], torch.int64),
                batch.upload(_padded([w[:-1] for _, _, w in words], -3), torch.int64),
                batch.upload([w[-1] for _, _, w in words], torch.int64))

    def apply(self, logits: torch.Tensor, state):
        rows, tails, index, prefixes, tokens = state
        match = ((tails[index] == prefixes) | (prefixes == -3)).all(1)
        # added, not written: two words may end in the same token of a row, one matching and one not
        logits.index_put_((rows, tokens), torch.where(match, float("-inf"), 0.0), accumulate=True)
