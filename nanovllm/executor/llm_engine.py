"""LLMEngine: one engine replica (engine/core.py's loop) with, under tensor parallelism, its
worker processes started; what LLM drives, and what data-parallel replicas run."""
from dataclasses import replace

from nanovllm.config import Config
from nanovllm.engine_args import EngineArgs
from nanovllm.engine.core import EngineCore
from nanovllm.executor.tp_workers import TPWorkers
from nanovllm.loader.source import safetensors_files
from nanovllm.models.registry import model_class


class LLMEngine(EngineCore):
    """vLLM's LLMEngine for one replica: `LLMEngine.from_engine_args(EngineArgs(model=..., ...))`,
    or `LLMEngine(Config.create(engine_args))`. With tensor_parallel_size > 1 this process is rank 0
    and starts the other ranks' processes. ValueError for an unsupported architecture, or data_parallel_size > 1 (one
    replica: LLM(..., data_parallel_size=N) runs several), before anything starts."""

    def __init__(self, config: Config):
        if config.data_parallel_size > 1:
            raise ValueError("LLMEngine is one replica; LLM(..., data_parallel_size=N) runs several")
        check_model(config)
        super().__init__(config, TPWorkers(config) if config.tensor_parallel_size > 1 else None)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs | str, **changes) -> "LLMEngine":
        """An engine of `engine_args` (vLLM's call), with `changes` to its fields; or of a model
        path or hub id and the engine arguments as keywords: from_engine_args(model, **engine_args)."""
        if isinstance(engine_args, str):
            args = EngineArgs.from_kwargs(engine_args, **changes)
        else:
            args = replace(engine_args, **changes)
        return cls(Config.create(args))


def check_model(config: Config):
    """Raise before anything starts: ValueError for an architecture nanovllm does not implement
    (naming those it does), a config it cannot serve or a tensor_parallel_size that does not
    split the model, or its experts with enable_expert_parallel (the model class's
    check_config); FileNotFoundError for a checkpoint without its weights."""
    model_class(config.hf_config).check_config(config.hf_config, config.tensor_parallel_size,
                                               config.enable_expert_parallel)
    if config.load_format == "safetensors":
        safetensors_files(config.model)
