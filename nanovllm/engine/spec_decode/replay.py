"""A proposer for measuring the speculative mechanism at a chosen acceptance: testing and benchmarks only."""
import random

from nanovllm.engine.spec_decode.proposer import Proposer
from nanovllm.sequence import Sequence


class ReplayProposer(Proposer):
    """speculative_config {"method": "replay", "acceptance_rate": a, "num_speculative_tokens": k}:
    replays the completion that this engine gave the same prompt in an earlier greedy run (recorded
    when that sequence finished: the longest), each draft token kept with probability a and otherwise replaced
    by another token, and the kept drafts before the first replaced one are accepted whatever the
    target samples there (forced_acceptance; the target's token follows them): a[i] = E[tokens
    accepted at position i] = a^(i+1). SYNTHETIC acceptance, to time verify steps at a controlled
    acceptance (bench.py) with any weights: random bf16 weights have near-tied logits, so a verify
    step's argmax leaves a decode step's record within a few dozen tokens, after which a replay
    without forcing would be all but rejected. While a run follows its record (float32, CPU) the
    forced drafts are the target's own greedy tokens; a prompt without a record gets no drafts."""

    def __init__(self, spec, vocab_size: int, seed: int):
        self.k, self.rate, self.vocab_size = spec.num_speculative_tokens, spec.acceptance_rate, vocab_size
        self.rng = random.Random(seed)
        self.records: dict[tuple[int, ...], list[int]] = {}  # prompt -> recorded greedy completion
        self.kept: dict[int, int] = {}  # seq_id -> its last proposal's drafts before the first replaced one

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        drafts = []
        for seq in seqs:
            record = self.records.get(tuple(seq.prompt_token_ids))
            if record is None:
                drafts.append([])
                continue
            done = seq.num_completion_tokens
            run = record[done:done + self.k]
            kept = len(run)
            for j, token in enumerate(run):  # Python's generator: its time counts in the verify steps timed
                if self.rng.random() >= self.rate:
                    run[j] = (token + self.rng.randrange(1, self.vocab_size)) % self.vocab_size
                    kept = min(kept, j)
            self.kept[seq.seq_id] = kept
            drafts.append(run)
        return drafts

    def forced_acceptance(self, seq: Sequence) -> int | None:
        return self.kept.pop(seq.seq_id, None)

    def finished(self, seq: Sequence) -> None:
        """Record a finished greedy completion, unless a longer one of its prompt is recorded (greedy
        runs of one prompt that stop at different places are prefixes of one another)."""
        prompt = tuple(seq.prompt_token_ids)
        if (seq.sampling_params.temperature == 0 and seq.finish_reason != "abort"
                and seq.num_completion_tokens > len(self.records.get(prompt, ()))):
            self.records[prompt] = seq.completion_token_ids
        self.kept.pop(seq.seq_id, None)
