from nanovllm.config import Config
from nanovllm.engine.data_parallel import DataParallelEngine
from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """The user-facing entry point: `LLM(model, **engine_args).generate(prompts, sampling_params)`.
    With data_parallel_size > 1 it returns a DataParallelEngine, whose generate() is the same."""

    def __new__(cls, model: str, **engine_args):
        if Config(model, **engine_args).data_parallel_size > 1:
            return DataParallelEngine(model, **engine_args)
        return super().__new__(cls)
