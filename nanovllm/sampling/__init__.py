"""Sampling: the step's SamplingParams as tensors (inputs.py), the logits processors
(logits_processors.py) and the Sampler (sampler.py) that draws one token per row, with the
logprobs a request asks for; warmup.py runs each of its paths once at start-up.
"""
