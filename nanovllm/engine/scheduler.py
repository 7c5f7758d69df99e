"""Decides which tokens run in each step (continuous batching with chunked prefill).

Each step has a budget of `max_num_batched_tokens`. Running sequences go first, oldest first:
a decoding sequence takes one token, one still in prefill takes the next chunk of its prompt
that fits. Waiting sequences are admitted next while budget, `max_num_seqs` and free KV blocks
allow, starting after their prefix-cache hit. When a running sequence needs a block and none is
free, the newest running sequence is preempted: its blocks are freed and it is recomputed later
(its generated tokens are kept). The KV pool always holds one `max_model_len` sequence, so the
oldest sequence always progresses and there is no deadlock. A waiting sequence that cannot start
yet is passed over, and those behind it go first: one whose grammar (structured outputs) is still
compiling (with nothing else to run, the scheduler waits for it), and, with max_loras, one of an
adapter that finds no slot (the running sequences run at most max_loras LoRA adapters, the
device's adapter slots).

A decoding sequence with draft tokens (drafts: proposed by EngineCore.add_draft_tokens) runs them
too, whole, after its token, while budget and free blocks allow; else they are dropped (they
follow its current last token). Those of the step are scheduled_drafts, which it verifies.
"""
from collections import deque

from nanovllm.engine.block_manager import BlockManager
from nanovllm.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, block_manager: BlockManager,
                 max_loras: int = 0):
        """max_loras: the most LoRA adapters among running sequences (0: no adapters served)."""
        self.max_num_seqs = max_num_seqs
        self.max_loras = max_loras
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.drafts: dict[int, list[int]] = {}  # seq_id -> draft tokens to verify in its next step
        self.scheduled_drafts: dict[int, list[int]] = {}  # those of the last schedule(), counted in its entries

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Return this step's (sequence, number of new tokens) pairs: running ones first, or in a
        decode-only step, longest context first; a sequence verifying drafts counts them
        (scheduled_drafts). Each sequence's num_computed_tokens already counts its new tokens (as
        in vLLM, the step is as good as launched)."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq) - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, n):
                preempted = True
                self._preempt(self.running.pop())
                if i == len(self.running):  # seq preempted itself
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
        self.scheduled_drafts = {}
        if self.drafts:
            budget = self._schedule_drafts(scheduled, budget)
        loras = {s.lora_int_id for s in self.running} - {0} if self.max_loras and self.waiting else set()
        skipped = []  # waiting sequences that cannot start yet, left waiting in order
        if not self.running:
            self._wait_for_a_grammar()
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if ((seq.grammar is not None and not seq.grammar.ready)
                    or (seq.lora_int_id and seq.lora_int_id not in loras and len(loras) >= self.max_loras)):
                skipped.append(self.waiting.popleft())
                continue
            cached = self.block_manager.find_cached_blocks(seq)
            n = min(len(seq) - len(cached) * self.block_manager.block_size, budget)
            if not self.block_manager.allocate_slots(seq, n, cached):
                break
            seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.block_manager.block_size
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
            if seq.lora_int_id:
                loras.add(seq.lora_int_id)
        self.waiting.extendleft(reversed(skipped))
        for seq, n in scheduled:
            seq.num_computed_tokens += n
        if all(n == 1 for _, n in scheduled):
            # longest context first: the decode kernel then starts the longest work first
            scheduled.sort(key=lambda item: item[0].num_computed_tokens, reverse=True)
        return scheduled

    def _wait_for_a_grammar(self):
        """With nothing running, a step has work only once a waiting sequence may start: when every
        one's grammar is still compiling (asking starts their compiles), wait for the first."""
        if self.waiting and all(s.grammar is not None and not s.grammar.ready for s in self.waiting):
            self.waiting[0].grammar.wait()

    def _schedule_drafts(self, scheduled: list[tuple[Sequence, int]], budget: int) -> int:
        """Extend each scheduled decode (one new token) of a sequence with drafts by its drafts, where
        the budget and free blocks allow; the others' drafts are dropped. Returns the budget left."""
        for i, (seq, n) in enumerate(scheduled):
            drafts = self.drafts.pop(seq.seq_id, None)
            if drafts and n == 1 and len(drafts) <= budget and self.block_manager.allocate_slots(seq, 1 + len(drafts)):
                scheduled[i] = (seq, 1 + len(drafts))
                self.scheduled_drafts[seq.seq_id] = drafts
                budget -= len(drafts)
        return budget

    def fork(self, parent: Sequence, child: Sequence) -> tuple[bool, tuple[int, int] | None]:
        """Start `child` (a copy of `parent`'s prompt, for SamplingParams.n) from `parent`'s KV, just
        computed: running beside it when max_num_seqs and a free block allow, else waiting first in
        line, to be prefilled on its own (mostly from the prefix cache). Returns (whether it was
        forked, the KV block copy it needs)."""
        copy = self.block_manager.fork(parent, child) if len(self.running) < self.max_num_seqs else False
        if copy is False:
            self.waiting.appendleft(child)
            return False, None
        child.status = SequenceStatus.RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        self.running.append(child)
        return True, copy

    def _preempt(self, seq: Sequence):
        self.block_manager.free(seq)
        self.drafts.pop(seq.seq_id, None)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str):
        """End `seq` and free its blocks: running, waiting (anywhere in the queue, e.g. aborted), or
        already ended (at its length when its last step launched, now by a stop in that step's
        token). A running one's full blocks of known, computed tokens go to the prefix cache first:
        a request that ends within a token or two of its prompt (max_tokens 1 or 2, EOS at once)
        has had no step read back after its prompt's. Blocks whose K/V a launched step is still
        writing are read only by later, stream-ordered steps."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.cache_full_blocks(seq, seq.num_known_tokens)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self.drafts.pop(seq.seq_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort_all(self) -> list[Sequence]:
        """Drop every unfinished sequence and free its blocks (after an interrupted generate)."""
        seqs = self.running + list(self.waiting)
        for seq in self.running:
            self.block_manager.free(seq)
        self.running, self.waiting = [], deque()
        self.drafts.clear()
        return seqs
