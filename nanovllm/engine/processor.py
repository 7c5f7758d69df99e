"""Requests in and out: validating and tokenizing prompts into Sequences, and finished
Sequences into RequestOutputs."""
from nanovllm.config import Config
from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams


class Processor:
    """config: the engine's resolved Config (tokenizer, vocabulary size, max_model_len)."""

    def __init__(self, config: Config):
        self.tokenizer = config.tokenizer
        self.vocab_size = config.hf_config.vocab_size
        self.max_model_len = config.max_model_len

    def normalize(self, prompts, sampling_params) -> list[tuple[object, SamplingParams]]:
        """A generate call's prompts paired with their SamplingParams (one for all, or one per
        prompt; None is the defaults). ValueError when the two do not pair up."""
        if isinstance(prompts, (str, dict)):
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
        return list(zip(prompts, sampling_params))

    def make_sequence(self, request_id: str, prompt, params: SamplingParams) -> Sequence:
        """Validate one request. prompt: a string, a list of token ids, or a dict with
        "prompt_token_ids" (and optionally its "prompt" text) or "prompt". Raises ValueError."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", text)
        return Sequence(self._token_ids(prompt), params, request_id, text)

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

    def output(self, seq: Sequence) -> RequestOutput:
        ids = seq.completion_token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, text, ids, seq.finish_reason,
                             seq.num_cached_tokens, seq.is_finished)
