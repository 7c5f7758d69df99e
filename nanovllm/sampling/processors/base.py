"""The logits processor interface: what changes a step's logits before temperature and the
top-k/top-p/min-p filters, one processor per file, listed in processors/__init__.py.

How a processor runs each step (rank 0, in the engine's StepSampler):
1. on the host, while the step is planned: for each sampled row whose SamplingParams has
   needs_processing set, applies(params) says whether this processor acts on it; prepare(batch,
   rows) gets the rows that said yes (none: it is not called) and uploads what apply() needs to
   the device, returning it as its state (None: nothing to do this step after all);
2. on the device, after the forward: apply(logits, state) on the step's [N, vocab] float32
   logits, in place, in the order of PROCESSORS, touching only its rows;
3. right after the draw: update(state, sampled), with the step's sampled token ids.
A step where no row carries a processor never calls it; rows without it cost it nothing.
"""
import numpy as np
import torch

from nanovllm.sampling_params import SamplingParams
from nanovllm.sequence import Sequence


class StepBatch:
    """The sequences sampled in a step, one logits row each, in row order (batch.seqs[row]), as
    prepare() sees them. A completion token not read back yet is PLACEHOLDER in seq.token_ids
    (only the last one can be): its value is on the device (last_sampled)."""

    def __init__(self, seqs: list[Sequence], device: torch.device, prev_rows: dict[int, int],
                 prev_sampled: torch.Tensor | None, draft_offsets: list[int] | None = None,
                 drafts: dict[int, list[int]] | None = None):
        """prev_rows: seq_id -> row of prev_sampled, the previous step's sampled tokens [M] int64 on
        the device (None when that step sampled nothing). A verify run's sequence is on several
        consecutive rows: draft_offsets[row], how many of its drafts (drafts[seq_id]) come
        before the position the row samples (None: no run in the step, every offset 0)."""
        self.seqs, self.device = seqs, device
        self.prev_rows, self.prev_sampled = prev_rows, prev_sampled
        self.draft_offsets, self.drafts = draft_offsets, drafts or {}

    def upload(self, values, dtype: torch.dtype) -> torch.Tensor:
        """A list (or array) of numbers as a tensor of dtype on the device, copied without waiting."""
        return torch.as_tensor(np.asarray(values), dtype=dtype).to(self.device, non_blocking=True)

    def last_sampled(self, seqs: list[Sequence]) -> torch.Tensor:
        """[len(seqs)] int64 on the device: the token each of seqs sampled in the previous step, for
        sequences whose last token is PLACEHOLDER (a KeyError for one that did not sample there)."""
        return self.prev_sampled[self.upload([self.prev_rows[seq.seq_id] for seq in seqs], torch.int64)]


class LogitsProcessor:
    """One way SamplingParams change the logits. Subclass it in a file of its own and add the class
    to PROCESSORS (processors/__init__.py), at the place in the order where it must apply; the
    engine makes one instance per rank-0 sampler, so an instance may keep state across steps.

    - What it reads of a request is a SamplingParams field whose validate() makes
      needs_processing true when set (the gate that keeps plain batches free of any processor
      work), or params.extra_args (a processor from outside the package). The engine's Processor
      (engine/processor.py) checks token ids against the vocabulary and tokenizes what needs the
      tokenizer (bad_words -> Sequence.bad_words_ids; structured_outputs -> a compiled grammar,
      and Sequence.grammar, each completion's matcher): a processor sees token ids only.
    - Per-row state that lasts across steps (penalties' token counts) is kept in the instance by
      seq_id: built in prepare() for a sequence that has none (its first sampled step, its return
      after a preemption, a forked child: from its token ids), advanced in update() with each
      step's sampled tokens, and dropped for sequences that no longer come
      (prepare sees every sampled sequence that carries the processor) and in reset().
      update() runs on the device right after the draw, before the tokens reach the host; a
      host-side state (a grammar matcher) that needs their values reads them from the Sequence
      in the next step, where the last one may still be PLACEHOLDER: batch.last_sampled()
      gives it on the device, and reading it on the host waits for the step that sampled it;
      done in prepare(), that wait comes before the step's forward is queued, so the grammar's
      processor (grammar_bitmask.py) copies them in update() and waits for that copy in apply().
    - A constraint that must hold whatever else changes the logits (a grammar's token bitmask:
      -inf outside the allowed tokens) goes first in PROCESSORS.
    - apply() must not synchronize with the host (.item(), .tolist(), torch.unique, boolean
      indexing): work out on the host, in prepare(), anything whose size depends on the data.
      Waiting for an event of an earlier step is fine there: the step's forward is queued by then.
    - Under tensor parallelism, a step where any row has processor state is sampled on rank 0
      from the gathered logits; the other ranks never see processors.
    """

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int], device: torch.device):
        """vocab_size: the logits' width; eos_token_ids: the model's end-of-sequence ids; device:
        where the logits and the processor's state live."""
        self.vocab_size, self.eos_token_ids, self.device = vocab_size, eos_token_ids, device

    def applies(self, params: SamplingParams) -> bool:
        """Whether rows of these params need this processor (asked only where params.needs_processing:
        what it reads must set that)."""
        raise NotImplementedError

    def prepare(self, batch: StepBatch, rows: list[int]):
        """The device tensors apply() needs for rows (ascending indices into batch.seqs, each with
        applies() true), uploaded without waiting; None when there is nothing to do this step."""
        raise NotImplementedError

    def apply(self, logits: torch.Tensor, state) -> None:
        """Change logits [N, vocab] float32 (a copy of the model's) in place, in the rows of state only."""
        raise NotImplementedError

    def update(self, state, sampled: torch.Tensor) -> None:
        """Advance per-row state with the step's sampled token ids [N] int64 (every row, in row
        order), on the device, drawn from the processed logits; nothing by default."""

    def reset(self) -> None:
        """Forget every sequence's state (the engine aborted its requests); nothing by default."""
