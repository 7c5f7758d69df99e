"""The sampling parameters of a step's sampled rows as device tensors (SamplingTensors, defined
beside the Sampler that reads them), built on the host from their Sequences. Each optional field
is None unless some row of the step uses it, so a plain batch pays for nothing it does not use."""
import numpy as np
import torch

from nanovllm.engine.sequence import PLACEHOLDER, Sequence
from nanovllm.layers.sampler import SamplingTensors


def _padded(rows: list[list[int]], pad: int, width: int = 0) -> np.ndarray:
    """Right-aligned rows in a [len(rows), max(width, longest)] array padded on the left with pad."""
    out = np.full((len(rows), max([width, *map(len, rows)])), pad, np.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, out.shape[1] - len(r):] = r
    return out


def sampling_tensors(seqs: list[Sequence], device: torch.device, vocab_size: int, eos_token_ids: frozenset,
                     prev_rows: dict[int, int], prev_sampled: torch.Tensor | None) -> SamplingTensors | None:
    """The step's SamplingTensors. A completion token not read back yet (PLACEHOLDER, the last
    one) is taken on the device from prev_sampled, at row prev_rows[seq_id]. A seeded row's noise
    is hashed from (its seed, its completion length), so it repeats whatever the batch and after
    a preemption. None when every row is plain greedy."""
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
        if any(p.top_k > 0 for p in params):
            st.top_k = dev([p.top_k for p in params], torch.int64)
            if all(p.top_k > 0 for p in params if p.temperature > 0):
                st.max_top_k = max(p.top_k for p in params)
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
    if bad_after or any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1 for _, _, p in rows):
        st.penalties = tuple(dev([getattr(p, name) for p in params], torch.float32)
                             for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"))
        output_ids = dev(_padded([seq.completion_token_ids for seq in seqs], vocab_size,
                                 max((len(w) for _, w, _ in bad_after), default=0)), torch.int64)
        pending = [(row, prev_rows[seq.seq_id]) for row, seq in enumerate(seqs)
                   if seq.num_completion_tokens and seq.token_ids[-1] == PLACEHOLDER]
        if pending:
            index, prev = dev([r for r, _ in pending], torch.int64), dev([p for _, p in pending], torch.int64)
            output_ids[index, -1] = prev_sampled[prev]
        st.output_ids = output_ids
        if any(p.repetition_penalty != 1 for _, _, p in rows):
            st.prompt_ids = dev(_padded([seq.prompt_token_ids if seq.sampling_params.repetition_penalty != 1 else []
                                         for seq in seqs], vocab_size), torch.int64)
    if bad_after:
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
