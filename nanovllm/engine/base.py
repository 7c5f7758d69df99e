"""The engine interface that the LLM facade drives; LLMEngine (one replica, nanovllm/executor/llm_engine.py) and
DataParallelEngine (several, nanovllm/executor/data_parallel.py) implement it."""
from abc import ABC, abstractmethod

from nanovllm.config import Config
from nanovllm.outputs import RequestOutput


class EngineBase(ABC):
    config: Config

    @abstractmethod
    def add_request(self, request_id: str, prompt, params, arrival_time: float | None = None,
                    lora_request=None, priority: int = 0) -> None:
        """Validate one request and queue it; ValueError (nothing queued) when it is invalid.
        prompt: a string, a list of token ids, or {"prompt_token_ids": [...], "prompt": text};
        arrival_time: vLLM's, which it keeps for its request metrics: requests run in the order
        they are added and RequestOutput.metrics is None here, so it changes nothing; lora_request:
        the LoRARequest of the adapter it runs with, or None; priority: 0 (no priority
        scheduling). The arguments in vLLM's LLMEngine.add_request's order."""

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """Advance the work by one step; returns the requests that changed in it, as each one's
        SamplingParams.output_kind says (FINAL_ONLY: only finished ones)."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        ...

    @abstractmethod
    def abort_request(self, request_id) -> None:
        """Drop the unfinished requests with these ids (one id or an iterable); unknown ids are ignored."""

    @abstractmethod
    def abort_all_requests(self) -> None:
        """Drop every unfinished request and free its KV blocks; the engine stays usable."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False while requests hold blocks."""

    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer, or None (vLLM's LLMEngine.tokenizer)."""
        return self.config.tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    def get_metrics(self) -> list:
        """The engine's metric records (engine/spec_decode/metrics.py); none by default."""
        return []
