"""The engine's speculative decoding: when it speculates, and how its proposals reach the verify seam."""
import time

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.spec_decode.metrics import SpecDecodeMetrics
from nanovllm.engine.spec_decode.proposer import make_proposer
from nanovllm.sequence import Sequence, SequenceStatus


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
    overlapped loop, without proposals."""

    def __init__(self, config, metrics: SpecDecodeMetrics):
        self.spec = config.speculative_config
        self.proposer = make_proposer(config)
        self.metrics = metrics

    def active(self, scheduler: Scheduler) -> bool:
        """Whether the next step speculates (disable_by_batch_size against the unfinished requests' sequences)."""
        limit = self.spec.disable_by_batch_size
        return limit is None or len(scheduler.running) + len(scheduler.waiting) <= limit

    def propose(self, engine) -> None:
        """Give each decoding sequence that can verify drafts (EngineCore.add_draft_tokens says which)
        the proposer's drafts."""
        seqs = [seq for seq in engine.scheduler.running
                if seq.num_computed_tokens == len(seq) - 1 and not seq.sampling_params.needs_processing]
        if not seqs:
            return
        start = time.perf_counter()
        drafts = self.proposer.propose(seqs)
        self.metrics.proposal_seconds += time.perf_counter() - start
        for seq, draft in zip(seqs, drafts):
            if draft:
                engine.add_draft_tokens(seq, draft)

    def finished(self, seq: Sequence) -> None:
        if seq.status == SequenceStatus.FINISHED:
            self.proposer.finished(seq)
