"""The engine interface that the LLM facade drives; LLMEngine (one replica, nanovllm/executor/llm_engine.py) and
DataParallelEngine (several, nanovllm/executor/data_parallel.py) implement it."""
from abc import ABC, abstractmethod

from nanovllm.config import Config
from nanovllm.outputs import RequestOutput


class EngineBase(ABC):
    config: Config

    @abstractmethod
    def add_request(self, request_id: str, prompt, params=None, arrival_time: float | None = None,
                    lora_request=None, priority: int = 0) -> None:
        """Validate one request and queue it; ValueError (nothing queued) when it is invalid.
        prompt: a string, a list of token ids, or {"prompt_token_ids": [...], "prompt": text};
        params: its SamplingParams (None: SamplingParams());
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

    # vLLM's LLMEngine adapter calls (llm.llm_engine.add_lora(...)); each raises ValueError on an
    # engine without enable_lora (_check_lora_enabled). The host cache is each rank's (each
    # replica's) cache of max_cpu_loras adapters that device slots are loaded from
    # (engine/lora_manager.py).

    @abstractmethod
    def add_lora(self, lora_request) -> bool:
        """Load the adapter of this LoRARequest into the host cache now (every tensor-parallel rank
        its shards, every data-parallel replica its own), so that requests with its lora_int_id
        find it there; as most recently used, the least recently used unpinned adapter leaving
        when the cache is full. An adapter already there is kept, not read again. Returns True.
        ValueError, nothing loaded, for an adapter a request could not run with either (no
        directory, rank above max_lora_rank, a target module without LoRA layers,
        modules_to_save, ...: loader/lora.py check_adapter; a lora_int_id already naming another
        path), or when every cached adapter is pinned."""

    @abstractmethod
    def remove_lora(self, lora_id: int) -> bool:
        """Drop the adapter from the host cache (unpinning it) and free its device slot. Requests
        still running with it go on: their next step reads it again from their LoRARequest's path.
        The id stays bound to that path (the prefix cache keeps blocks by id). Returns whether it
        was in the cache or a slot (of any replica)."""

    @abstractmethod
    def list_loras(self) -> set[int]:
        """The lora_int_ids in the host cache (rank 0's; the other ranks' hold the same; with data
        parallelism, those in any replica's). An adapter the cache's LRU has dropped while it
        still runs in a device slot is not among them (its next load into a slot reads it again)."""

    @abstractmethod
    def pin_lora(self, lora_id: int) -> bool:
        """Keep the adapter in the host cache until remove_lora: LRU never drops it for another
        (with every cached adapter pinned, another is read from disk whenever it takes a slot).
        Device slots are unchanged: the running requests' adapters share them. Returns True.
        ValueError naming the id when it is not in list_loras() (with data parallelism: when a
        replica lacks it; add_lora loads it on every replica)."""

    def _check_lora_enabled(self, method: str):
        if not self.config.enable_lora:
            raise ValueError(f"{method} needs an engine with LoRA enabled: LLM(model, enable_lora=True, "
                             f"max_loras=..., max_lora_rank=...)")

    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer, or None (vLLM's LLMEngine.tokenizer)."""
        return self.config.tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    def get_metrics(self) -> list:
        """The engine's metric records (engine/spec_decode/metrics.py); none by default."""
        return []
