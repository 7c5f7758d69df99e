"""What generate returns (vLLM's RequestOutput, with nano-vllm's shortcuts)."""
from dataclasses import dataclass


@dataclass
class RequestOutput:
    """One finished request. `token_ids` holds the completion only; finish_reason is "stop"
    (EOS or a stop token), "length" (max_tokens or max_model_len) or "abort". out["text"] works too."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finished: bool = True

    def __getitem__(self, key: str):
        return getattr(self, key)
