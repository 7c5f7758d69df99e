from dataclasses import dataclass


@dataclass
class SamplingParams:
    """How to pick each next token; names and meanings follow vLLM's `SamplingParams`.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it. Must be >= 0.
    top_k: keep the k most likely tokens; -1 (or 0) keeps all.
    top_p: keep the smallest set of tokens whose probability sums to >= top_p; in (0, 1].
    min_p: drop tokens whose probability is below min_p times the most likely one's; in [0, 1].
    max_tokens: most tokens to generate (>= 1); finish_reason "length" when reached.
    ignore_eos: keep generating past the end-of-sequence token.
    stop_token_ids: further token ids that end the completion (finish_reason "stop").
    seed: per-request seed; the same seed and prompt give the same completion.
    """
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    seed: int | None = None

    def __post_init__(self):
        self.validate()

    def validate(self):
        """Raise ValueError naming the first field that is out of range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all), 0 (all) or a positive integer, got {self.top_k!r}")
        if self.stop_token_ids is not None and not all(isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
