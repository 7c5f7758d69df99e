"""What generate and LLMEngine.step return: vLLM's RequestOutput, CompletionOutput and Logprob.

nano-vllm's shortcuts still work: `out.text`, `out.token_ids`, `out.finish_reason`, `out["text"]`
and `out["token_ids"]` read the first completion, `out.outputs[0]`.
"""
from dataclasses import dataclass


@dataclass
class Logprob:
    """logprob: natural log of the token's probability; rank: 1 for the most likely token;
    decoded_token: its text (None when the request has detokenize=False)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per position, {token id: Logprob} with the sampled (or prompt) token and the top-`logprobs` ones
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One of a request's n completions. token_ids: the completion's ids (a stop token id is kept,
    a stop string is cut from text unless include_stop_str_in_output). finish_reason: "stop" (EOS,
    a stop token or string), "length" (max_tokens or max_model_len), "abort", or None while running.
    stop_reason: the stop string or stop token id that ended it, else None (also for EOS).
    cumulative_logprob: sum of the sampled tokens' log-probabilities, when logprobs were asked."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's state: its prompt, its completions (`outputs`, ordered by index) and whether
    all of them finished. prompt_logprobs: None for the first prompt token, then one dict per token."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: SampleLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    def __getitem__(self, key: str):
        """out["text"] / out["token_ids"]: nano-vllm's dict-style access to the first completion."""
        return getattr(self, key)
