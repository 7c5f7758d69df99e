"""Sampling: the step's SamplingParams as tensors (inputs.py), the logits processors
(processors/, one file each, applied in the order of processors.PROCESSORS), the Sampler
(sampler.py) that draws one token per row with the logprobs a request asks for, tensor
parallelism's draw from vocabulary shards (tp_shards.py), and StepSampler (step_sampler.py), the
engine's one entry point to all of it; warmup.py runs each of its
paths once at start-up.
"""
