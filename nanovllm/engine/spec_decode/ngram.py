"""Prompt-lookup (n-gram) proposals: drafts copied from earlier in the sequence itself."""
import numpy as np

from nanovllm.engine.spec_decode.proposer import Proposer
from nanovllm.sequence import Sequence


def ngram_drafts(histories: list[np.ndarray], min_n: int, max_n: int, k: int) -> list[list[int]]:
    """For each token history (int64 [L_i], every token known), the up to k tokens that followed
    the earliest occurrence of its longest suffix n-gram, min_n <= n <= max_n, found earlier in it
    (the occurrence may overlap the suffix, but must end before the last token); [] where none is
    found. The whole batch is one flat array and each step is a numpy pass over it: the match
    length at every candidate end e (how many tokens before e, counting e, equal the history's last
    ones) grows by one comparison per n, up to max_n, so the work is O(max_n * sum L_i)."""
    if not histories:
        return []
    lens = np.fromiter(map(len, histories), np.int64, len(histories))
    tokens = np.concatenate(histories)
    starts = np.zeros_like(lens)
    np.cumsum(lens[:-1], out=starts[1:])
    seq_of = np.repeat(np.arange(len(lens)), lens)
    local = np.arange(tokens.size) - starts[seq_of]  # each candidate end's index in its history
    last = (starts + lens - 1)[seq_of]  # each position's history's last token
    match_len = np.zeros(tokens.size, np.int64)
    still = local < lens[seq_of] - 1  # a match must end before the last token, which it is compared to
    for j in range(max_n):
        still &= local >= j
        if not still.any():
            break
        idx = np.flatnonzero(still)
        still[idx] = tokens[idx - j] == tokens[last[idx] - j]
        match_len += still
    # per history, the longest match, and of those the earliest: the largest key
    big = int(lens.max()) + 1
    key = match_len * big + (big - 1 - local)
    best = np.maximum.reduceat(key, starts)
    best_len, best_end = best // big, big - 1 - best % big
    drafts = []
    for history, n, end in zip(histories, best_len.tolist(), best_end.tolist()):
        drafts.append(history[end + 1:end + 1 + k].tolist() if n >= min_n else [])
    return drafts


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
