"""The Sampler's paths run once at start-up, so that the first generate that uses top-k,
top-p/min-p, penalties or logprobs compiles no Triton kernel inside the call (on CUDA each path
is a kernel specialised on the logits' dtype; elsewhere the paths are torch's and compile nothing)."""
import torch

from nanovllm.sampling.inputs import sampling_tensors
from nanovllm.sampling.processors import PROCESSORS
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence

# One batch per path of Sampler.forward on CUDA: the logits as the model makes them, and after
# penalties (which make them float32). The top-k kernels take k at run time: top_k=20 compiles
# what every top_k (and logprobs) up to 64 runs.
WARMUP_BATCHES = (
    dict(temperature=1.0),  # the Gumbel-max kernel
    dict(temperature=1.0, top_p=0.9, min_p=0.05),  # the nucleus kernel
    dict(temperature=1.0, top_k=20),  # chunked top-k and the top-k kernel
    dict(temperature=0.0, logprobs=1),  # logsumexp and rank, chunked top-k, of the raw logits
    dict(temperature=1.0, repetition_penalty=1.1),  # the penalty kernel with the prompt's tokens; float32 Gumbel-max
    dict(temperature=1.0, presence_penalty=0.5, top_p=0.9),  # the penalty kernel; float32 nucleus
    dict(temperature=1.0, frequency_penalty=0.5, top_k=20),  # float32 top-k
    dict(temperature=1.0, frequency_penalty=0.5, logprobs=1),  # processed_logprobs: float32 logsumexp and top-k
)


def warm_up_sampler(logprobs_mode: str, vocab_size: int, dtype: torch.dtype, device: torch.device):
    """Sample two rows of random logits [2, vocab_size] in `dtype` on `device` with each batch of
    WARMUP_BATCHES, through a Sampler and logits processors of its own (the engine's random
    generator and the processors' per-sequence state are left as they were). A few milliseconds once compiled; Triton's cache on disk
    keeps the compiled kernels across processes."""
    sampler, processors = Sampler(0, logprobs_mode), [cls(vocab_size, frozenset(), device) for cls in PROCESSORS]
    generator = torch.Generator(device).manual_seed(0)  # torch's global one is left as it was too
    logits = torch.randn(2, vocab_size, device=device, generator=generator).to(dtype)
    for fields in WARMUP_BATCHES:
        params = SamplingParams(max_tokens=1, **fields)
        seqs = [Sequence([0, 1], params) for _ in range(2)]
        sampler(logits, sampling_tensors(seqs, device, processors, {}, None, vocab_size))
