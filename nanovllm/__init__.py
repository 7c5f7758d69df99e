from nanovllm.engine_args import EngineArgs
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.inputs import TextPrompt, TokensPrompt
from nanovllm.llm import LLM
from nanovllm.executor.llm_engine import LLMEngine
from nanovllm.lora.request import LoRARequest
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "LoRARequest", "SamplingParams", "StructuredOutputsParams",
           "RequestOutput", "CompletionOutput", "Logprob", "TextPrompt", "TokensPrompt"]
