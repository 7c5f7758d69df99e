from nanovllm.outputs import RequestOutput
from nanovllm.llm import LLM
from nanovllm.executor.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredOutputsParams", "RequestOutput"]
