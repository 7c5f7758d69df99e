"""Speculative decoding: proposers of draft tokens (n-gram, draft model, EAGLE-3 head; replay for
measurements), the Speculator that feeds them to the engine's verify seam
(EngineCore.add_draft_tokens), and the acceptance metrics."""
from nanovllm.engine.spec_decode.metrics import SpecDecodeMetrics
from nanovllm.engine.spec_decode.proposer import make_proposer
from nanovllm.engine.spec_decode.speculator import Speculator

__all__ = ["SpecDecodeMetrics", "Speculator", "make_proposer"]
