"""The engine's speculative decoding: when it speculates, and how its proposals reach the verify seam."""
import time

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.spec_decode.metrics import SpecDecodeMetrics
from nanovllm.engine.spec_decode.proposer import Proposer
from nanovllm.sequence import Sequence, SequenceStatus

MAX_IDLE_SKIP = 4  # the most overlapped steps after speculative steps in which nothing was proposed


class Speculator:
    """Proposes drafts for the decoding sequences before each speculative step.

    How it meets the overlapped steps: a proposal follows a sequence's last token, and with steps
    overlapped that token is still on the GPU (PLACEHOLDER) when the next step is planned. Guessing
    it too (proposing from the known prefix) would waste every following draft whenever the guess
    or the step in flight's own drafts miss, and with a verify run in flight the next step's row
    is thrown away on every rejection. So a speculative step syncs: the engine reads the step in
    flight first (EngineCore.step), every token is then known and every proposal exact, and each
    step verifies what it proposes. The price is the host's scheduling time, no longer hidden behind
    the GPU; it is paid only while speculating: at most disable_by_batch_size unfinished requests,
    where a verify step's several tokens per weight read pay for it. Larger batches run the plain
    overlapped loop, without proposals. So do the steps after a speculative step in which nothing
    was proposed (text that does not repeat itself, for n-gram): 1, then 2, then MAX_IDLE_SKIP
    steps while that goes on, none once something is proposed again; a repetitive stretch is
    then found a few tokens late, and free text costs the sync on a few steps in MAX_IDLE_SKIP + 1.

    uniform (the model runner has CUDA graphs, captured per (batch size, q_len)): in a step where
    some sequence has drafts, every decoding sequence gets exactly k, so that a step of decodes is
    uniform (q_len 1 + k) and replays a graph rather than running eagerly: a short proposal repeats
    itself (an n-gram's continuation that reaches the end of the sequence is a period of it), an
    empty one is the last token k times. At the batch sizes that speculate the extra rows cost
    little: a decode step's time is the weights' read. Where some decoding sequence cannot take k
    (within k + 2 tokens of its max_tokens, or with a logits processor other than a grammar:
    EngineCore.draft_room), or the step's budget (max_num_batched_tokens) cannot hold 1 + k
    tokens for each, no sequence gets drafts that step: an eager step of a model's every kernel
    costs more than the drafts would win (a batch's every sequence passes its last k tokens so)."""

    def __init__(self, config, proposer: Proposer, metrics: SpecDecodeMetrics, uniform: bool = False):
        self.spec, self.uniform, self.budget = config.speculative_config, uniform, config.max_num_batched_tokens
        self.proposer = proposer
        self.metrics = metrics
        self.max_idle_skip = MAX_IDLE_SKIP
        self._idle = self._skip = 0  # the current idle skip, and the steps of it left

    def active(self, scheduler: Scheduler) -> bool:
        """Whether the next step speculates: disable_by_batch_size against the unfinished requests'
        sequences, and no idle skip left."""
        limit = self.spec.disable_by_batch_size
        if limit is not None and len(scheduler.running) + len(scheduler.waiting) > limit:
            return False
        if self._skip:
            self._skip -= 1
            return False
        return True

    def propose(self, engine) -> None:
        """Give each decoding sequence that can verify drafts (EngineCore.add_draft_tokens says which)
        the proposer's drafts."""
        decoding = [seq for seq in engine.scheduler.running if seq.num_computed_tokens == len(seq) - 1]
        seqs = [seq for seq in decoding if seq.sampling_params.takes_drafts]
        k = self.spec.num_speculative_tokens
        if not seqs or (self.uniform and ((1 + k) * len(decoding) > self.budget
                                          or any(engine.draft_room(seq) < k for seq in decoding))):
            return
        start = time.perf_counter()
        drafts = self.proposer.propose(seqs)
        self.metrics.proposal_seconds += time.perf_counter() - start
        if not any(drafts):
            self._idle = self._skip = min(2 * self._idle or 1, self.max_idle_skip)
            return
        self._idle = 0
        if self.uniform:
            drafts = [(draft * k)[:k] if draft else [seq.token_ids[-1]] * k for seq, draft in zip(seqs, drafts)]
        for seq, draft in zip(seqs, drafts):
            if draft:
                engine.add_draft_tokens(seq, draft)

    def finished(self, seq: Sequence) -> None:
        if seq.status == SequenceStatus.FINISHED:
            self.proposer.finished(seq)
