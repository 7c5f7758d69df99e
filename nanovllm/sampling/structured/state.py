"""GrammarState: one completion's grammar matcher (Sequence.grammar), fed its tokens."""
import logging

from nanovllm.sampling.structured.backend import Matcher
from nanovllm.sampling.structured.compiler import Grammar
from nanovllm.sequence import PLACEHOLDER, Sequence

logger = logging.getLogger(__name__)


class GrammarState:
    """The matcher of one completion (each of a request's n completions has its own), made from
    the request's Grammar when first needed. advance() feeds it the completion's tokens it has not
    taken yet, whichever reads them first: the grammar's logits processor (the previous step's
    token, read from the device, to mask the next) or the engine's stop check (each token once it
    is read back). A preempted sequence keeps its state; tokens taken back (speculative drafts
    that were rejected) are rolled back.

    finished: the grammar is complete (only EOS may follow) or refused a token (possible only when
    the request's other constraints, e.g. allowed_token_ids, left no token the grammar allows);
    either way the completion ends."""
    __slots__ = ("grammar", "matcher", "num_accepted", "refused")

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.matcher: Matcher | None = None
        self.num_accepted = 0  # completion tokens the matcher has taken
        self.refused = False

    @property
    def ready(self) -> bool:
        """Whether the grammar is compiled (the scheduler starts the sequence only then)."""
        return self.grammar.ready

    def wait(self) -> None:
        self.grammar.wait()

    @property
    def finished(self) -> bool:
        return self.refused or (self.matcher is not None and self.matcher.stopped)

    def advance(self, seq: Sequence, last: int | None = None) -> bool:
        """Feed the matcher seq's completion tokens it has not taken, up to a trailing PLACEHOLDER
        (or through it, with last its value); returns finished."""
        matcher = self.matcher
        if matcher is None:
            matcher = self.matcher = self.grammar.matcher()
        ids, start = seq.token_ids, seq.num_prompt_tokens + self.num_accepted
        if len(ids) < start:
            self.rollback(start - len(ids))
        for i in range(start, len(ids)):
            if self.refused or matcher.stopped:
                break
            token = ids[i]
            if token == PLACEHOLDER:
                if last is None:
                    break
                token = last
            if not matcher.accept(token):
                self._refuse(seq, token)
                break
            self.num_accepted += 1
        return self.finished

    def rollback(self, num_tokens: int) -> None:
        """Take back the last num_tokens accepted tokens."""
        self.matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    def _refuse(self, seq: Sequence, token: int) -> None:
        self.refused = True
        logger.warning("request %s: its grammar does not allow token %d, which its other constraints left as the "
                       "only choice; the completion ends", seq.request_id, token)


def advance_all(seqs: list[Sequence], last: dict[int, int]) -> list[bool]:
    """GrammarState.advance of each of seqs (last: seq_id -> the value of a trailing PLACEHOLDER);
    the completions with one token to take (a step's) hand it to the backend together, which may
    take them on its own threads. Returns each one's finished."""
    batch, tokens = [], []
    for seq in seqs:
        state, token = seq.grammar, seq.token_ids[-1]
        if token == PLACEHOLDER:
            token = last.get(seq.seq_id)
        if (state.matcher is not None and token is not None and not state.finished
                and len(seq.token_ids) == seq.num_prompt_tokens + state.num_accepted + 1):
            batch.append(seq)
            tokens.append(token)
        else:
            state.advance(seq, last.get(seq.seq_id))
    if batch:
        accepted = batch[0].grammar.grammar.backend.accept_tokens([seq.grammar.matcher for seq in batch], tokens)
        for seq, token, ok in zip(batch, tokens, accepted):
            if ok:
                seq.grammar.num_accepted += 1
            else:
                seq.grammar._refuse(seq, token)
    return [seq.grammar.finished for seq in seqs]
