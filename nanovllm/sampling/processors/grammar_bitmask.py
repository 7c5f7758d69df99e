"""structured_outputs: each constrained row may sample only what its grammar allows next.

How this keeps the engine's steps overlapped. Step t+1 is launched before step t's tokens reach
the host, but a row's mask needs its grammar advanced past its step-t token. So the mask is made
in apply(), which runs after step t+1's forward has been queued on the device: it waits for step
t's sampled tokens alone (the copy update() queued right after step t's draw; the forward of t+1
runs meanwhile), advances the matchers, fills the bitmask on the library's threads and queues its
upload and the masking, which the rest of the sampling follows. The device idles only if this
host work outlasts the forward. Unconstrained rows share the step and wait for nothing more; a
step without constrained rows never calls this processor. The alternatives cost more: leaving a
constrained sequence out of every other step halves its rate and starves the device when most
rows are constrained; waiting for step t before scheduling t+1 gives up the overlap of every row.
"""
from dataclasses import dataclass

import torch

from nanovllm.sampling.processors.base import LogitsProcessor, StepBatch
from nanovllm.sampling.structured.backend import token_bits
from nanovllm.sampling.structured.state import advance_all
from nanovllm.sequence import PLACEHOLDER, Sequence


@dataclass
class GrammarStep:
    """The constrained rows of a step: their sequences (each with its GrammarState, seq.grammar),
    their rows [R] int64 of the logits, on the device, and the drafts before each row's position
    (offsets[i] of drafts[seq_id], a verify run's rows; 0 elsewhere)."""
    seqs: list[Sequence]
    rows: torch.Tensor
    offsets: list[int]
    drafts: dict[int, list[int]]


class GrammarBitmask(LogitsProcessor):
    """The token bitmask of each constrained row's grammar: -inf at every token it does not allow
    next (also at the logits' columns past the tokenizer's vocabulary, which no grammar allows).
    A row whose grammar is complete (or refused a token) allows only EOS; the engine's stop
    check ends such a completion. First in PROCESSORS, so that what follows sees the grammar's
    choices only. On CUDA one pass over the masked rows (kernels/token_bitmask.py)."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int], device: torch.device):
        super().__init__(vocab_size, eos_token_ids, device)
        self.num_words = -(-vocab_size // 32)
        self.eos_row = token_bits([t for t in eos_token_ids if t < vocab_size], self.num_words)
        self.bitmask = torch.empty(0, self.num_words, dtype=torch.int32)  # host, pinned on CUDA
        cuda = device.type == "cuda"
        self.uploaded = torch.cuda.Event() if cuda else None  # the bitmask's last copy ran
        self.tokens = torch.empty(0, dtype=torch.int64)  # host, pinned: update()'s copies of the sampled tokens
        self.copied = torch.cuda.Event() if cuda else None  # the last of those copies ran
        self.last: tuple[dict[int, int], torch.Tensor | None] = ({}, None)  # update()'s seq_id -> index, tokens

    def applies(self, params) -> bool:
        return params.structured_outputs is not None

    def prepare(self, batch: StepBatch, rows: list[int]) -> GrammarStep:
        offsets = [batch.draft_offsets[row] for row in rows] if batch.draft_offsets else [0] * len(rows)
        return GrammarStep([batch.seqs[row] for row in rows], batch.upload(rows, torch.int64), offsets, batch.drafts)

    def apply(self, logits: torch.Tensor, state: GrammarStep):
        """The rows' masks, draft position by draft position: a verify run's row j is masked by the
        grammar after the run's first j drafts, which the matcher takes while the row before
        allows them (and gives back once every row is filled); rows after a draft the grammar
        does not allow get EOS alone, which nothing reads: the target cannot sample that draft."""
        seqs, offsets = state.seqs, state.offsets
        last = self._last_tokens(seqs)
        bitmask = self._host_bitmask(len(seqs))
        host = bitmask.numpy()
        levels: dict[int, list[int]] = {}
        for i, offset in enumerate(offsets):
            levels.setdefault(offset, []).append(i)
        row_of: dict[int, int] = {}  # seq_id -> its row at the previous level
        taken: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (seq, drafts its matcher took): given back
        for offset in sorted(levels):
            live = []
            if offset == 0:
                finished = dict(zip(levels[0], advance_all([seqs[i] for i in levels[0]], last)))
            for i in levels[offset]:
                seq = seqs[i]
                if offset == 0:
                    done = finished[i]
                else:
                    before = row_of[seq.seq_id]
                    done = before < 0 or not self._take_draft(seq, state.drafts[seq.seq_id][offset - 1], host[before])
                    if not done:
                        taken[seq.seq_id] = seq, offset
                if done:
                    host[i] = self.eos_row
                    row_of[seq.seq_id] = -1  # its later rows: EOS alone
                else:
                    live.append(i)
                    row_of[seq.seq_id] = i
            if live:
                seqs[live[0]].grammar.grammar.backend.fill_bitmask([seqs[i].grammar.matcher for i in live], bitmask,
                                                                   live)
        for seq, num_drafts in taken.values():
            seq.grammar.matcher.rollback(num_drafts)
        mask = bitmask[:len(seqs)].to(logits.device, non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record()
        apply_token_bitmask(logits, state.rows, mask)

    def update(self, state: GrammarStep, sampled: torch.Tensor):
        tokens, index = sampled[state.rows], {seq.seq_id: i for i, seq in enumerate(state.seqs)}
        if not tokens.is_cuda:
            self.last = index, tokens
            return
        if self.tokens.numel() < tokens.numel():  # rarely: allocating pinned memory synchronizes
            self.tokens = torch.empty(max(256, 2 * tokens.numel()), dtype=torch.int64, pin_memory=True)
        host = self.tokens[:tokens.numel()]
        host.copy_(tokens, non_blocking=True)
        self.copied.record()
        self.last = index, host

    def reset(self):
        self.last = ({}, None)

    def _take_draft(self, seq: Sequence, token: int, allowed) -> bool:
        """Feed seq's matcher a draft that allowed (the mask row [num_words] int32 of the position
        before it) allows; False, nothing taken, where it does not, or for EOS (the completion
        ends there: what follows is never read)."""
        if token in self.eos_token_ids or not (int(allowed[token >> 5]) >> (token & 31)) & 1:
            return False
        seq.grammar.matcher.accept(token)  # allowed: it cannot refuse
        return True

    def _last_tokens(self, seqs: list[Sequence]) -> dict[int, int]:
        """seq_id -> the token each of seqs sampled in the previous step, for those whose last
        token is not read back yet (PLACEHOLDER); waits for that step's draw only."""
        pending = [seq for seq in seqs if seq.token_ids[-1] == PLACEHOLDER]
        if not pending:
            return {}
        index, host = self.last
        if self.copied is not None:
            self.copied.synchronize()
        values = host.tolist()
        return {seq.seq_id: values[index[seq.seq_id]] for seq in pending}

    def _host_bitmask(self, rows: int) -> torch.Tensor:
        """The host bitmask [>= rows, num_words] int32, free to refill (its last upload has run)."""
        if self.bitmask.size(0) < rows:  # rarely: allocating pinned memory synchronizes
            self.bitmask = torch.empty(max(rows, 256, 2 * self.bitmask.size(0)), self.num_words, dtype=torch.int32,
                                       pin_memory=self.device.type == "cuda")
        elif self.uploaded is not None:
            self.uploaded.synchronize()
        return self.bitmask


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor):
    """Set to -inf, in rows [R] int64 of logits [N, vocab], each token whose bit is clear in the
    row's bitmask [R, ceil(vocab / 32)] int32 (bit b of word w: token 32 w + b), in place."""
    if logits.is_cuda:
        from nanovllm.kernels.token_bitmask import apply_token_bitmask_kernel
        return apply_token_bitmask_kernel(logits, rows, bitmask)
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1
    allowed = bits.flatten(1)[:, :logits.size(1)].bool()
    if allowed.size(1) < logits.size(1):
        allowed = torch.nn.functional.pad(allowed, (0, logits.size(1) - allowed.size(1)))
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
