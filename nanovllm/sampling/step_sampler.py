"""StepSampler: the engine's one entry point to sampling, on every rank of a ModelRunner."""
import torch

from nanovllm.sampling import processors
from nanovllm.sampling.inputs import sampling_tensors
from nanovllm.sampling.sampler import Sampler, SamplingTensors, TokenLogprobs
from nanovllm.sampling.tp_shards import draws_from_shards, sample_from_shards
from nanovllm.sequence import Sequence


class StepSampler:
    """Each step's sampling on one rank: prepare() builds the step's SamplingTensors from its
    sequences (rank 0, on the host; the logits processors of processors.PROCESSORS, one instance
    each, keep their per-sequence state across steps), and calling it with the step's logits
    draws its tokens (forward). Under tensor parallelism every rank calls it with the logits of its
    vocabulary shard and rank 0's SamplingTensors (for_workers() on the other ranks): either each
    rank draws from its shard (tp_shards.py) or rank 0 gathers the logits and samples them."""

    def __init__(self, config, lm_head, device: torch.device):
        """config: the engine's Config (seed, logprobs_mode, eos_token_ids, the model's
        vocab_size); lm_head: the model's ParallelLMHead (this rank's vocabulary shard)."""
        self.lm_head, self.device = lm_head, device
        self.sampler = Sampler(config.seed, config.logprobs_mode)
        self.vocab_size = config.hf_config.vocab_size
        self.processors = [cls(config.hf_config.vocab_size, config.eos_token_ids, device)
                           for cls in processors.PROCESSORS]

    def prepare(self, seqs: list[Sequence], prev_rows: dict[int, int], prev_sampled: torch.Tensor | None,
                draft_offsets: list[int] | None = None, drafts: dict[int, list[int]] | None = None) -> SamplingTensors:
        """The SamplingTensors of seqs, the step's sampled sequences in row order (see sampling_tensors)."""
        st = sampling_tensors(seqs, self.device, self.processors, prev_rows, prev_sampled, self.vocab_size,
                              draft_offsets, drafts)
        st.from_shards = self.lm_head.tp_size > 1 and draws_from_shards(st)
        return st

    def forward(self, logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, TokenLogprobs | None] | None:
        """logits [N, vocab / tp_size] (this rank's shard; the model dtype or float32) -> (token
        ids [N] int64, TokenLogprobs of st.logprob_rows or None) on rank 0, None on the others."""
        lm_head = self.lm_head
        if lm_head.tp_size > 1:
            if st.from_shards:
                sampled = sample_from_shards(logits, st, self.sampler, lm_head)
                return None if sampled is None else (sampled, None)
            logits = lm_head.gather(logits)
            if logits is None:
                return None
        return self.sampler(logits, st)

    def __call__(self, logits: torch.Tensor, st: SamplingTensors):
        return self.forward(logits, st)

    def reset(self):
        """Forget every sequence's processor state (after the engine aborted its requests)."""
        for processor in self.processors:
            processor.reset()
