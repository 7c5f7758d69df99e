from nanovllm.outputs import RequestOutput
from nanovllm.llm import LLM
from nanovllm.executor.llm_engine import LLMEngine
from nanovllm.lora_request import LoRARequest
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "LoRARequest", "SamplingParams", "RequestOutput"]
