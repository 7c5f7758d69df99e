"""Decides which tokens run in each step (continuous batching with chunked prefill).

Each step has a budget of `max_num_batched_tokens`. Running sequences go first, oldest first:
a decoding sequence takes one token, one still in prefill takes the next chunk of its prompt
that fits. Waiting sequences are admitted next while budget, `max_num_seqs` and free KV blocks
allow, starting after their prefix-cache hit; one whose grammar (structured outputs) is still
compiling waits, and those behind it may go first. When a running sequence needs a block and
none is free, the newest running sequence is preempted: its blocks are freed and it is
recomputed later (its generated tokens are kept). The KV pool always holds one `max_model_len`
sequence, so the oldest sequence always progresses and there is no deadlock.
"""
from collections import deque

from nanovllm.engine.block_manager import BlockManager
from nanovllm.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, block_manager: BlockManager):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Return this step's (sequence, number of new tokens) pairs: running ones first, or in a
        decode-only step, longest context first. Each sequence's num_computed_tokens already
        counts its new tokens (as in vLLM, the step is as good as launched)."""
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
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = next((s for s in self.waiting if s.grammar is None or s.grammar.ready), None)
            if seq is None:
                if not scheduled and not self.running:  # nothing to run until a grammar is compiled
                    self.waiting[0].grammar.wait()
                    continue
                break
            cached = self.block_manager.find_cached_blocks(seq)
            n = min(len(seq) - len(cached) * self.block_manager.block_size, budget)
            if not self.block_manager.allocate_slots(seq, n, cached):
                break
            seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.block_manager.block_size
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        for seq, n in scheduled:
            seq.num_computed_tokens += n
        if all(n == 1 for _, n in scheduled):
            # longest context first: the decode kernel then starts the longest work first
            scheduled.sort(key=lambda item: item[0].num_computed_tokens, reverse=True)
        return scheduled

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
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str):
        """End `seq` (running, or waiting after a preemption) and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort_all(self) -> list[Sequence]:
        """Drop every unfinished sequence and free its blocks (after an interrupted generate)."""
        seqs = self.running + list(self.waiting)
        for seq in self.running:
            self.block_manager.free(seq)
        self.running, self.waiting = [], deque()
        return seqs
