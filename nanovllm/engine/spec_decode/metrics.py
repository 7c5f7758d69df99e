"""Speculative decoding's acceptance counts, and the metric records that LLM.get_metrics() returns
(the shape of vLLM's vllm.v1.metrics.reader: each record has a name and labels, and a value
(Counter, Gauge) or values (Vector))."""
from dataclasses import dataclass, field


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    values: list[int] = field(default_factory=list)


class SpecDecodeMetrics:
    """Counts over every verify run an engine checked: num_drafts (runs), num_draft_tokens,
    num_accepted_tokens (drafts equal to the target's token, up to the first that was not) and
    accepted_per_pos[i] (runs whose draft i was accepted); proposal_seconds: host time in the
    proposer."""

    def __init__(self, num_speculative_tokens: int = 0):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens
        self.proposal_seconds = 0.0

    def record(self, num_draft_tokens: int, num_accepted: int):
        """One verify run of num_draft_tokens drafts whose first num_accepted were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if num_draft_tokens > len(self.accepted_per_pos):
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify run gives on average: 1 (the target's own) + the accepted drafts; 0 before any run."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_rates(self) -> list[float]:
        """Per draft position i, the share of verify runs whose draft i was accepted (vLLM's per-position rate)."""
        return [n / self.num_drafts if self.num_drafts else 0.0 for n in self.accepted_per_pos]

    def postfix(self) -> str:
        """The progress bar's note: mean acceptance length and per-position acceptance."""
        rates = ",".join(f"{r:.2f}" for r in self.acceptance_rates())
        return f"spec accept len {self.mean_acceptance_length:.2f}, per pos {rates}"

    def metrics(self) -> list[Metric]:
        """vLLM's spec-decode metric names (so a script written for vLLM's get_metrics() reads them),
        and nanovllm's proposal time."""
        return [Counter("vllm:spec_decode_num_drafts", value=self.num_drafts),
                Counter("vllm:spec_decode_num_draft_tokens", value=self.num_draft_tokens),
                Counter("vllm:spec_decode_num_accepted_tokens", value=self.num_accepted_tokens),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos", values=list(self.accepted_per_pos)),
                Gauge("nanovllm:spec_decode_proposal_seconds", value=self.proposal_seconds)]
