from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """The user-facing entry point: `LLM(model, **engine_args).generate(prompts, sampling_params)`."""
