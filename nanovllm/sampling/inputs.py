"""The sampling parameters of a step's sampled rows as device tensors (SamplingTensors, defined
beside the Sampler that reads them), built on the host from their Sequences. Each optional field
is None unless some row of the step uses it, so a plain batch pays for nothing it does not use."""
import numpy as np
import torch

from nanovllm.sequence import PLACEHOLDER, Sequence
from nanovllm.sampling.sampler import SamplingTensors


def _padded(rows: list[list[int]], pad: int, width: int = 0) -> np.ndarray:
    """Right-aligned rows in a [len(rows), max(width, longest)] array padded on the left with pad."""
    out = np.full((len(rows), max([width, *map(len, rows)])), pad, np.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, out.shape[1] - len(r):] = r
    return out


class TokenCounts:
    """For each penalised sequence of the step, on the device: how often each token occurs in its
    completion (counts [rows, vocab] int32) and, for repetition_penalty, which tokens its prompt
    holds (prompt_mask [rows, vocab] bool). A row is built from the sequence's token ids when it
    enters a step without one (its first sampled step, or its return after a preemption); after
    that the step's sampled tokens are added on the device (add), so no step uploads or scans
    whole completions. A sequence that leaves a step gives its row back. Row 0 is scratch for the
    rows of a step that have no penalties. Rows grow by doubling, up to max_num_seqs + 1 (5 bytes
    per vocabulary entry each: 0.2 GB for 256 sequences of Qwen3's 151,936 tokens, allocated
    outside the KV pool's budget, only once a request asks for penalties)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.rows: dict[int, int] = {}  # seq_id -> row
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)

    def step_rows(self, seqs: list[Sequence], prev_rows: dict[int, int], prev_sampled: torch.Tensor | None,
                  upload) -> torch.Tensor:
        """[len(seqs)] int64 on the device: each sequence's row (0 for those without penalties)."""
        penalised = [seq for seq in seqs if seq.sampling_params.has_penalties]
        live = {seq.seq_id for seq in penalised}
        self.rows = {sid: row for sid, row in self.rows.items() if sid in live}
        new = [seq for seq in penalised if seq.seq_id not in self.rows]
        if new:
            self._build(new, prev_rows, prev_sampled, upload)
        return upload([self.rows.get(seq.seq_id, 0) for seq in seqs], torch.int64)

    def _build(self, new: list[Sequence], prev_rows, prev_sampled, upload):
        free = sorted(set(range(1, self.counts.size(0))) - set(self.rows.values()))
        if len(free) < len(new):
            size = max(2 * self.counts.size(0), len(self.rows) + len(new) + 1)
            grown = [torch.zeros(size, self.vocab_size, dtype=t.dtype, device=self.device) for t in (self.counts, self.prompt_mask)]
            grown[0][:self.counts.size(0)], grown[1][:self.counts.size(0)] = self.counts, self.prompt_mask
            free += range(max(1, self.counts.size(0)), size)  # row 0: scratch
            self.counts, self.prompt_mask = grown
        rows = free[:len(new)]
        self.rows |= {seq.seq_id: row for seq, row in zip(new, rows)}
        index = upload(rows, torch.int64)
        self.counts[index] = 0
        self.prompt_mask[index] = False
        # a completion token not read back yet (PLACEHOLDER) is the previous step's, on the device
        flat = [(seq, row, t) for seq, row in zip(new, rows) for t in seq.completion_token_ids]
        if flat:
            ids = upload([t for _, _, t in flat], torch.int64)
            pending = [(i, prev_rows[seq.seq_id]) for i, (seq, _, t) in enumerate(flat) if t == PLACEHOLDER]
            if pending:
                ids[upload([i for i, _ in pending], torch.int64)] = prev_sampled[upload([r for _, r in pending], torch.int64)]
            self.add(upload([row for _, row, _ in flat], torch.int64), ids)
        prompt = [(row, t) for seq, row in zip(new, rows) if seq.sampling_params.repetition_penalty != 1
                  for t in seq.prompt_token_ids]
        if prompt:
            self.prompt_mask[upload([r for r, _ in prompt], torch.int64), upload([t for _, t in prompt], torch.int64)] = True

    def add(self, rows: torch.Tensor, sampled: torch.Tensor):
        """Count the step's sampled tokens [N] in their sequences' rows [N] (step_rows)."""
        self.counts.index_put_((rows, sampled), torch.ones_like(sampled, dtype=torch.int32), accumulate=True)


def sampling_tensors(seqs: list[Sequence], device: torch.device, vocab_size: int, eos_token_ids: frozenset,
                     prev_rows: dict[int, int], prev_sampled: torch.Tensor | None,
                     token_counts: TokenCounts) -> SamplingTensors | None:
    """The step's SamplingTensors. A completion token not read back yet (PLACEHOLDER, the last
    one) is taken on the device from prev_sampled, at row prev_rows[seq_id]. A seeded row's noise
    is hashed from (its seed, its completion length), so it repeats whatever the batch and after
    a preemption. Penalties read token_counts (whose rows the caller updates with the sampled
    tokens: TokenCounts.add(st.count_rows, ...)). None when every row is plain greedy."""
    params = [seq.sampling_params for seq in seqs]
    if not any(p.temperature > 0 or p.needs_processing or p.logprobs is not None for p in params):
        return None
    st = SamplingTensors()

    def dev(values, dtype):
        return torch.as_tensor(np.asarray(values), dtype=dtype).to(device, non_blocking=True)

    def pairs(items):  # [(row, token)] -> (rows, tokens) on the device, or None
        return (dev([r for r, _ in items], torch.int64), dev([t for _, t in items], torch.int64)) if items else None

    if any(p.temperature > 0 for p in params):
        st.temperatures = dev([p.temperature for p in params], torch.float32)
        top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]  # the whole vocabulary: no top-k (vLLM's)
        if any(top_k):
            st.top_k = dev(top_k, torch.int64)
            if all(k for k, p in zip(top_k, params) if p.temperature > 0):
                st.max_top_k = max(top_k)
        if any(p.top_p < 1 for p in params):
            st.top_p = dev([p.top_p for p in params], torch.float32)
        if any(p.min_p > 0 for p in params):
            st.min_p = dev([p.min_p for p in params], torch.float32)
        seeded = [(row, hash((seq.seed, seq.num_completion_tokens)) & 0x7FFFFFFF) for row, (seq, p)
                  in enumerate(zip(seqs, params)) if p.seed is not None and p.temperature > 0]
        st.seeds = (dev([r for r, _ in seeded], torch.int64), dev([s for _, s in seeded], torch.int64)) if seeded else None
    logprob_rows = [row for row, p in enumerate(params) if p.logprobs is not None]
    if logprob_rows:
        st.num_logprobs = max(params[r].logprobs for r in logprob_rows)
        st.logprob_rows = dev(logprob_rows, torch.int64)
    # the rest only for rows whose logits are processed (none in a plain batch)
    rows = [(row, seq, p) for row, (seq, p) in enumerate(zip(seqs, params)) if p.needs_processing]
    if not rows:
        return st
    bad_after = [(row, w[:-1], w[-1]) for row, seq, _ in rows for w in seq.bad_words_ids if len(w) > 1]
    if any(p.has_penalties for _, _, p in rows):
        st.penalties = tuple(dev([getattr(p, name) for p in params], torch.float32)
                             for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"))
        st.count_rows = token_counts.step_rows(seqs, prev_rows, prev_sampled, dev)
        st.token_counts = token_counts.counts
        if any(p.repetition_penalty != 1 for _, _, p in rows):
            st.prompt_mask = token_counts.prompt_mask
    if bad_after:  # the last tokens of each completion, as long as the longest prefix
        width = max(len(w) for _, w, _ in bad_after)
        output_ids = dev(_padded([seq.completion_token_ids[-width:] for seq in seqs], vocab_size, width), torch.int64)
        pending = [(row, prev_rows[seq.seq_id]) for row, seq in enumerate(seqs)
                   if seq.num_completion_tokens and seq.token_ids[-1] == PLACEHOLDER]
        if pending:
            index, prev = dev([r for r, _ in pending], torch.int64), dev([p for _, p in pending], torch.int64)
            output_ids[index, -1] = prev_sampled[prev]
        st.output_ids = output_ids
        st.banned_after = (dev([r for r, _, _ in bad_after], torch.int64),
                           dev(_padded([p for _, p, _ in bad_after], -3), torch.int64),
                           dev([t for _, _, t in bad_after], torch.int64))
    bias = [(row, t, b) for row, _, p in rows for t, b in (p.logit_bias or {}).items()]
    if bias:
        st.logit_bias = (*pairs([(r, t) for r, t, _ in bias]), dev([b for _, _, b in bias], torch.float32))
    banned = [(row, t) for row, seq, _ in rows for w in seq.bad_words_ids if len(w) == 1 for t in w]
    for row, seq, p in rows:
        if seq.num_completion_tokens < p.min_tokens:  # counts the PLACEHOLDER: the sampled token is the next
            banned += [(row, t) for t in (*(() if p.ignore_eos else eos_token_ids), *(p.stop_token_ids or ()))]
    st.banned = pairs(banned)
    st.allowed = pairs([(row, t) for row, _, p in rows for t in p.allowed_token_ids or ()])
    return st
