"""Prompt-lookup (n-gram) proposals: drafts copied from earlier in the sequence itself."""
import numpy as np

from nanovllm.engine.spec_decode.proposer import Proposer
from nanovllm.sequence import Sequence


def ngram_drafts(histories: list[np.ndarray], min_n: int, max_n: int, k: int) -> list[list[int]]:
    """For each token history (int64 [L_i], every token known), the up to k tokens that followed
    the earliest occurrence of its longest suffix n-gram, min_n <= n <= max_n, found earlier in it
    (the occurrence may overlap the suffix, but must end before the last token); [] where none is
    found (vLLM's rule). The batch is one flat array: the candidate ends whose token equals their
    history's last one are found in one pass over it, and each further n keeps those whose token n
    back also equals the history's; so the work is one pass plus the (few) surviving candidates."""
    if not histories:
        return []
    lens = np.fromiter(map(len, histories), np.int64, len(histories))
    tokens = np.concatenate(histories)
    starts = np.zeros_like(lens)
    np.cumsum(lens[:-1], out=starts[1:])
    lasts = starts + lens - 1
    seq_of = np.repeat(np.arange(len(lens)), lens)
    cand = np.flatnonzero(tokens == tokens[lasts][seq_of])  # match length >= 1, ascending
    cand = cand[cand != lasts[seq_of[cand]]]  # a match ends before the last token
    levels = []  # levels[j]: the candidate ends whose match is at least j + 1 long
    for j in range(max_n):
        if j:
            cand = cand[cand - j >= starts[seq_of[cand]]]
            cand = cand[tokens[cand - j] == tokens[lasts[seq_of[cand]] - j]]
        if not cand.size:
            break
        levels.append(cand)
    best = np.full(len(lens), -1, np.int64)  # each history's match end; -1: none
    for ends in reversed(levels[min_n - 1:]):  # longest first; the first of a history's ends is its earliest
        owners, first = np.unique(seq_of[ends], return_index=True)
        free = best[owners] < 0
        best[owners[free]] = ends[first[free]] - starts[owners[free]]
    return [h[e + 1:e + 1 + k].tolist() if e >= 0 else [] for h, e in zip(histories, best.tolist())]


class NgramProposer(Proposer):
    """vLLM's "ngram" method (prompt lookup decoding): the k tokens after the earliest occurrence of
    the sequence's longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min tokens) in its
    prompt and completion so far. Each sequence's tokens are kept in a numpy buffer that only
    grows by the tokens added since its last proposal (a known token never changes)."""

    def __init__(self, spec):
        self.k, self.min_n, self.max_n = spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        self._buffers: dict[int, tuple[np.ndarray, int]] = {}  # seq_id -> (buffer, tokens in it)

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        buffers, self._buffers = self._buffers, {}  # sequences not asked for now are dropped (rebuilt if they return)
        histories = []
        for seq in seqs:
            buf, n = buffers.get(seq.seq_id, (None, 0))
            length = len(seq)
            if buf is None or buf.size < length:
                grown = np.empty(max(2 * length, 256), np.int64)
                if n:
                    grown[:n] = buf[:n]
                buf = grown
            buf[n:length] = seq.token_ids[n:length]
            self._buffers[seq.seq_id] = (buf, length)
            histories.append(buf[:length])
        return ngram_drafts(histories, self.min_n, self.max_n, self.k)
