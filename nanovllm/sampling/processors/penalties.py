"""presence_penalty, frequency_penalty and repetition_penalty, over token counts kept on the device."""
from dataclasses import dataclass

import torch

from nanovllm.sampling.processors.base import LogitsProcessor, StepBatch
from nanovllm.sequence import PLACEHOLDER, Sequence


class TokenCounts:
    """For each penalised sequence, on the device: how often each token occurs in its completion
    (counts [rows, vocab] int32) and, for repetition_penalty, which tokens its prompt holds
    (prompt_mask [rows, vocab] bool). A row is built from the sequence's token ids when it enters a
    step without one (its first sampled step, or its return after a preemption); after that the
    step's sampled tokens are added on the device (add), so no step uploads or scans whole
    completions. A sequence that leaves a step gives its row back. Rows grow by doubling, up to
    max_num_seqs (5 bytes per vocabulary entry each: 0.2 GB for 256 sequences of Qwen3's 151,936
    tokens, allocated outside the KV pool's budget, only once a request asks for penalties)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.rows: dict[int, int] = {}  # seq_id -> row
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)

    def step_rows(self, seqs: list[Sequence], batch: StepBatch) -> torch.Tensor:
        """[len(seqs)] int64 on the device: the rows of the step's penalised sequences (all of them)."""
        live = {seq.seq_id for seq in seqs}
        self.rows = {sid: row for sid, row in self.rows.items() if sid in live}
        new = [seq for seq in seqs if seq.seq_id not in self.rows]
        if new:
            self._build(new, batch)
        return batch.upload([self.rows[seq.seq_id] for seq in seqs], torch.int64)

    def _build(self, new: list[Sequence], batch: StepBatch):
        free = sorted(set(range(self.counts.size(0))) - set(self.rows.values()))
        if len(free) < len(new):
            size = max(2 * self.counts.size(0), len(self.rows) + len(new))
            grown = [torch.zeros(size, self.vocab_size, dtype=t.dtype, device=self.device) for t in (self.counts, self.prompt_mask)]
            grown[0][:self.counts.size(0)], grown[1][:self.counts.size(0)] = self.counts, self.prompt_mask
            free += range(self.counts.size(0), size)
            self.counts, self.prompt_mask = grown
        rows = free[:len(new)]
        self.rows |= {seq.seq_id: row for seq, row in zip(new, rows)}
        upload = batch.upload
        index = upload(rows, torch.int64)
        self.counts[index] = 0
        self.prompt_mask[index] = False
        # a completion token not read back yet (PLACEHOLDER) is the previous step's, on the device
        flat = [(seq, row, t) for seq, row in zip(new, rows) for t in seq.completion_token_ids]
        if flat:
            ids = upload([t for _, _, t in flat], torch.int64)
            pending = [(i, seq) for i, (seq, _, t) in enumerate(flat) if t == PLACEHOLDER]
            if pending:
                ids[upload([i for i, _ in pending], torch.int64)] = batch.last_sampled([seq for _, seq in pending])
            self.add(upload([row for _, row, _ in flat], torch.int64), ids)
        prompt = [(row, t) for seq, row in zip(new, rows) if seq.sampling_params.repetition_penalty != 1
                  for t in seq.prompt_token_ids]
        if prompt:
            self.prompt_mask[upload([r for r, _ in prompt], torch.int64), upload([t for _, t in prompt], torch.int64)] = True

    def add(self, rows: torch.Tensor, sampled: torch.Tensor):
        """Count tokens sampled [K] int64 in rows [K] int64 (step_rows)."""
        self.counts.index_put_((rows, sampled), torch.ones_like(sampled, dtype=torch.int32), accumulate=True)


@dataclass
class PenaltyState:
    """R penalised rows: rows [R] int64 (of the logits), their sequences' rows count_rows [R] int64
    of counts [C, vocab] int32 and, when some row has a repetition_penalty, of prompt_mask [C,
    vocab] bool (else None); presence, frequency, repetition [R] float32."""
    rows: torch.Tensor
    count_rows: torch.Tensor
    counts: torch.Tensor
    prompt_mask: torch.Tensor | None
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor


class Penalties(LogitsProcessor):
    """repetition_penalty over the tokens of prompt and completion (CTRL, Keskar et al. 2019: a
    positive logit divided by it, a negative one multiplied, as transformers'
    RepetitionPenaltyLogitsProcessor); then presence_penalty once and frequency_penalty per
    occurrence over the completion's tokens (OpenAI's API definition). On CUDA one pass over the
    rows' logits (kernels/penalty.py)."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int], device: torch.device):
        super().__init__(vocab_size, eos_token_ids, device)
        self.token_counts = TokenCounts(vocab_size, device)

    def applies(self, params) -> bool:
        return params.has_penalties

    def prepare(self, batch: StepBatch, rows: list[int]) -> PenaltyState:
        params = [batch.seqs[r].sampling_params for r in rows]
        tc = self.token_counts
        count_rows = tc.step_rows([batch.seqs[r] for r in rows], batch)
        prompt_mask = tc.prompt_mask if any(p.repetition_penalty != 1 for p in params) else None
        return PenaltyState(batch.upload(rows, torch.int64), count_rows, tc.counts, prompt_mask,
                            *(batch.upload([getattr(p, name) for p in params], torch.float32)
                              for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")))

    def apply(self, logits: torch.Tensor, state: PenaltyState):
        apply_penalties(logits, state)

    def update(self, state: PenaltyState, sampled: torch.Tensor):
        self.token_counts.add(state.count_rows, sampled[state.rows])

    def reset(self):
        self.token_counts.rows = {}


def apply_penalties(logits: torch.Tensor, s: PenaltyState):
    """The penalties of s on logits [N, vocab] float32, in place (rows outside s.rows untouched)."""
    if logits.is_cuda:
        from nanovllm.kernels.penalty import apply_penalties_kernel
        return apply_penalties_kernel(logits, s.rows, s.counts, s.prompt_mask, s.count_rows, s.presence,
                                      s.frequency, s.repetition)
    x = logits[s.rows]
    counts = s.counts[s.count_rows].float()
    seen = counts > 0
    if s.prompt_mask is not None:
        seen |= s.prompt_mask[s.count_rows]
    r = s.repetition.unsqueeze(1)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x -= s.frequency.unsqueeze(1) * counts + s.presence.unsqueeze(1) * (counts > 0)
    logits[s.rows] = x
