"""The sampling parameters of a step's sampled rows as device tensors (SamplingTensors, defined
beside the Sampler that reads them), built on the host from their Sequences, one row each in row
order. Each optional field is None (and each logits processor absent) unless some row of the step
uses it, so a plain batch pays for nothing it does not use."""
import torch

from nanovllm.sampling.processors import LogitsProcessor, StepBatch
from nanovllm.sampling.sampler import SamplingTensors
from nanovllm.sequence import Sequence


def sampling_tensors(seqs: list[Sequence], device: torch.device, processors: list[LogitsProcessor],
                     prev_rows: dict[int, int], prev_sampled: torch.Tensor | None, vocab_size: int,
                     draft_offsets: list[int] | None = None, drafts: dict[int, list[int]] | None = None
                     ) -> SamplingTensors:
    """The step's SamplingTensors. A seeded row's noise is hashed from (its seed, the completion
    index of the token it samples: the sequence's completion length, plus draft_offsets[row] where
    given), so it repeats whatever the batch and after a preemption; a verify run's rows (its
    sequence on consecutive rows, engine/step_inputs.plan_step) sample the positions after each of
    its drafts (drafts: seq_id -> a run's drafts). processors: in the order they apply; each
    prepares the rows that carry it (LogitsProcessor.prepare), among those whose params need
    processing (a verify run's only for a grammar: SamplingParams.takes_drafts). A completion
    token not read back yet (PLACEHOLDER, the last one) is prev_sampled[prev_rows[seq_id]] on the
    device. vocab_size: the logits' width (a top_k at or above it is no top-k, as vLLM's). Every
    field empty when every row is plain greedy."""
    params = [seq.sampling_params for seq in seqs]
    st = SamplingTensors()
    if not any(p.temperature > 0 or p.needs_processing or p.logprobs is not None for p in params):
        return st
    batch = StepBatch(seqs, device, prev_rows, prev_sampled, draft_offsets, drafts)
    dev = batch.upload
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
        seeded = [(row, hash((seq.seed, seq.num_completion_tokens + (draft_offsets[row] if draft_offsets else 0)))
                   & 0x7FFFFFFF) for row, (seq, p) in enumerate(zip(seqs, params)) if seq.seed is not None and p.temperature > 0]
        st.seeds = (dev([r for r, _ in seeded], torch.int64), dev([s for _, s in seeded], torch.int64)) if seeded else None
    logprob_rows = [row for row, p in enumerate(params) if p.logprobs is not None]
    if logprob_rows:
        st.num_logprobs = max(params[r].logprobs for r in logprob_rows)
        st.logprob_rows = dev(logprob_rows, torch.int64)
    rows = [row for row, p in enumerate(params) if p.needs_processing]  # none in a plain batch
    if rows:
        for processor in processors:
            mine = [row for row in rows if processor.applies(params[row])]
            state = processor.prepare(batch, mine) if mine else None
            if state is not None:
                st.processors.append((processor, state))
    return st
