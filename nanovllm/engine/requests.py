"""Requests in and out: validating and tokenizing prompts, and building RequestOutputs."""
from dataclasses import dataclass

from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    """One finished request. `token_ids` holds the completion only; finish_reason is "stop"
    (EOS or a stop token) or "length" (max_tokens or max_model_len). out["text"] works too."""
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def __getitem__(self, key: str):
        return getattr(self, key)


class RequestProcessor:
    """Turns a generate call's prompts into Sequences and finished Sequences into RequestOutputs.

    config: the engine's Config; source: its ModelSource (hf_config and tokenizer).
    Raises ValueError when max_model_len exceeds the model's max_position_embeddings."""

    def __init__(self, config, source):
        hf_config = source.hf_config
        max_pos = hf_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > max_pos:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_pos}")
        self.max_model_len = config.max_model_len or max_pos
        self.tokenizer = source.tokenizer
        self.vocab_size = hf_config.vocab_size
        ids = getattr(hf_config, "eos_token_id", None)
        self.eos_token_ids = set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

    def to_sequences(self, prompts, sampling_params) -> list[Sequence]:
        """Validate every request before any work; ValueError names the request index and the problem."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or (prompts and all(isinstance(p, int) for p in prompts)):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts; "
                             f"pass one, or one per prompt")
        seqs = []
        for i, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
            try:
                if not isinstance(sp, SamplingParams):
                    raise ValueError(f"sampling params must be SamplingParams, got {type(sp).__name__}")
                sp.validate()
                seqs.append(Sequence(self._token_ids(prompt), sp))
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        return seqs

    def _token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as token-id lists")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        else:
            raise ValueError(f"a prompt must be a string or a list of ints, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        return ids

    def output(self, index: int, prompt, seq: Sequence) -> RequestOutput:
        ids = seq.completion_token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""
        return RequestOutput(index, prompt if isinstance(prompt, str) else None, seq.prompt_token_ids, text,
                             ids, seq.finish_reason, seq.num_cached_tokens)
