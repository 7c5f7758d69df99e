"""The proposer interface: who guesses the next tokens of decoding sequences."""
from nanovllm.sequence import Sequence


class Proposer:
    """Proposes draft tokens on the host for decoding sequences, whose every token is known
    (none is PLACEHOLDER: the engine reads the step in flight first, engine/spec_decode/speculator.py).
    The engine verifies them in the sequence's next step (EngineCore.add_draft_tokens)."""
    aux_layers: tuple[int, ...] = ()  # target layers whose input hidden states the proposer reads (EAGLE-3)

    def bind(self, runner) -> None:
        """Meet the target's ModelRunner once it is built (after the proposer, whose memory comes first)."""

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        """For each sequence, at most num_speculative_tokens draft token ids (ints) to follow its
        last token; [] for none."""
        raise NotImplementedError

    def forced_acceptance(self, seq: Sequence) -> int | None:
        """How many of the drafts that seq verified in its last step count as accepted whatever the
        target sampled at their positions: None, the target decides (every real proposer's
        answer; the synthetic replay proposer's is its own, replay.py)."""
        return None

    def finished(self, seq: Sequence) -> None:
        """`seq` is finished and its tokens are final; nothing by default."""


def make_proposer(config) -> Proposer:
    """The Proposer of config.speculative_config.method (a resolved SpeculativeConfig)."""
    spec = config.speculative_config
    if spec.method == "ngram":
        from nanovllm.engine.spec_decode.ngram import NgramProposer
        return NgramProposer(spec)
    if spec.method == "replay":
        from nanovllm.engine.spec_decode.replay import ReplayProposer
        return ReplayProposer(spec, config.hf_config.vocab_size, config.seed)
    if spec.method == "draft_model":
        from nanovllm.engine.spec_decode.draft_model import DraftModelProposer
        return DraftModelProposer(config)
    if spec.method == "eagle3":
        from nanovllm.engine.spec_decode.eagle3 import Eagle3Proposer
        return Eagle3Proposer(config)
    raise ValueError(f"no proposer for speculative method {spec.method!r}")
