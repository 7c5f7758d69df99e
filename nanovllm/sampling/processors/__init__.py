"""The logits processors, in the order they apply to a step's logits: a grammar's token bitmask
(structured_outputs) first, then vLLM's (allowed_token_ids, bad words, min_tokens, logit_bias,
then the penalties). The bans commute with one another and with the penalties; only logit_bias
must come before the penalties. A new processor is a file of its own here (base.py says what it
implements) and a line in PROCESSORS; one that constrains the whole vocabulary goes first."""
from nanovllm.sampling.processors.allowed_token_ids import AllowedTokenIds
from nanovllm.sampling.processors.bad_words import BadWords
from nanovllm.sampling.processors.banned_tokens import BannedTokens
from nanovllm.sampling.processors.base import LogitsProcessor, StepBatch
from nanovllm.sampling.processors.grammar_bitmask import GrammarBitmask
from nanovllm.sampling.processors.logit_bias import LogitBias
from nanovllm.sampling.processors.penalties import Penalties

PROCESSORS: list[type[LogitsProcessor]] = [GrammarBitmask, AllowedTokenIds, BadWords, BannedTokens, LogitBias,
                                           Penalties]

__all__ = ["PROCESSORS", "LogitsProcessor", "StepBatch"]
