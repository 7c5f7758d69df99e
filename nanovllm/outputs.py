"""What generate and LLMEngine.step return: vLLM's RequestOutput, CompletionOutput and Logprob.

nano-vllm's shortcuts still work: `out.text`, `out.token_ids`, `out.finish_reason`, `out["text"]`
and `out["token_ids"]` read the first completion, `out.outputs[0]`.
"""
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class Logprob:
    """logprob: natural log of the token's probability; rank: 1 for the most likely token;
    decoded_token: its text (None when the request has detokenize=False)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class SampleLogprobs(Sequence):
    """vLLM's SampleLogprobs (and PromptLogprobs): per position, {token id: Logprob} with the
    sampled (or prompt) token and the top k; None for a prompt's first position. A sequence that
    makes each dict when it is read: a throughput run with logprobs=5 would otherwise build six
    objects per token that nobody reads (vLLM's FlatLogprobs does the same). positions: per
    position None or (arrays, row), arrays the step's (token ids, logprobs, ranks) [rows, 1 + K]
    (K >= k) and row this position's; decode: token id -> its text or None. Pickled (across
    processes) as a plain list of dicts."""

    def __init__(self, positions: list, k: int, decode: Callable[[int], str | None]):
        self._positions, self._k, self._decode = positions, k, decode

    def __len__(self) -> int:
        return len(self._positions)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return SampleLogprobs(self._positions[i], self._k, self._decode)
        if self._positions[i] is None:
            return None
        arrays, row = self._positions[i]
        ids, logprobs, ranks = (a[row, :self._k + 1].tolist() for a in arrays)
        return {t: Logprob(lp, r, self._decode(t)) for t, lp, r in zip(ids, logprobs, ranks)}

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, SampleLogprobs)) and list(self) == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self):
        return list, (list(self),)


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
    lora_request: object = None  # the LoRARequest it ran with, or None

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
