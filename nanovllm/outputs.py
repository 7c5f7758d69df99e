"""What generate and LLMEngine.step return: vLLM's RequestOutput, CompletionOutput and Logprob.

Logprobs are vLLM's: per position a dict {token id: Logprob} of the sampled (or prompt) token and
the top k, in a plain list (SampleLogprobs, PromptLogprobs), or, with
SamplingParams(flat_logprobs=True), in a FlatLogprobs sequence that makes each dict when it is read.

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


def position_logprobs(position, k: int, decode: Callable[[int], str | None]) -> dict[int, Logprob] | None:
    """One position's {token id: Logprob}: the token and the top k, from position = (arrays, row),
    arrays a step's (token ids, logprobs, ranks) [rows, 1 + K] (K >= k) and row this position's;
    decode: token id -> its text or None. None (a prompt's first position) stays None."""
    if position is None:
        return None
    arrays, row = position
    ids, logprobs, ranks = (a[row, :k + 1].tolist() for a in arrays)
    return {t: Logprob(lp, r, decode(t)) for t, lp, r in zip(ids, logprobs, ranks)}


class FlatLogprobs(Sequence):
    """vLLM's FlatLogprobs (SamplingParams(flat_logprobs=True)): the positions' logprobs as a
    read-only sequence whose item i, {token id: Logprob} (or None), is made when it is read: a
    throughput run with logprobs=5 would otherwise build six objects per token that nobody reads.
    positions: per position None or (arrays, row), as position_logprobs takes them. Pickled
    (across processes) as a plain list of dicts."""

    def __init__(self, positions: list, k: int, decode: Callable[[int], str | None]):
        self._positions, self._k, self._decode = positions, k, decode

    def __len__(self) -> int:
        return len(self._positions)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return FlatLogprobs(self._positions[i], self._k, self._decode)
        return position_logprobs(self._positions[i], self._k, self._decode)

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, FlatLogprobs)) and list(self) == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self):
        return list, (list(self),)


SampleLogprobs = list[dict[int, Logprob]] | FlatLogprobs  # per completion token
PromptLogprobs = list[dict[int, Logprob] | None] | FlatLogprobs  # per prompt token, None for the first


@dataclass
class CompletionOutput:
    """One of a request's n completions. token_ids: the completion's ids (a stop token id is kept,
    a stop string is cut from text unless include_stop_str_in_output). finish_reason: "stop" (EOS,
    a stop token or string), "length" (max_tokens or max_model_len), "abort", or None while running.
    stop_reason: the stop string or stop token id that ended it, else None (also for EOS).
    cumulative_logprob: sum of the sampled tokens' log-probabilities, when logprobs were asked.
    logprobs: per token {token id: Logprob} of it and the top SamplingParams.logprobs."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None  # a list of dicts; FlatLogprobs with flat_logprobs=True
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's state: its prompt, its completions (`outputs`, ordered by index) and whether
    all of them finished. prompt_logprobs: None for the first prompt token, then one dict per token
    (a list; FlatLogprobs with flat_logprobs=True)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    lora_request: object = None  # the LoRARequest it ran with, or None
    # None: no per-request timings are kept (as vLLM's LLM leaves it, whose disable_log_stats is on)
    metrics: None = None

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
