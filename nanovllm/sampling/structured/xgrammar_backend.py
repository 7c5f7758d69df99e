"""xgrammar (https://github.com/mlc-ai/xgrammar, vLLM's default) behind structured outputs: a
grammar is compiled ahead of time against the vocabulary (its token sets precomputed per parser
state; seconds for a rich schema, on the compile pool), then each mask is mostly a cache lookup."""
import json

import numpy as np
import torch
import xgrammar

from nanovllm.sampling.structured.backend import GrammarBackend, Matcher, choice_rule, json_schema, token_bits
from nanovllm.sampling_params import StructuredOutputsParams


class XGrammarMatcher(Matcher):
    """xgrammar's matcher terminates only once it takes a stop token; stopped is also set by
    fill_bitmask when the grammar is complete and its mask allows stop tokens alone."""
    __slots__ = ("matcher", "stopped")

    def __init__(self, matcher: xgrammar.GrammarMatcher):
        self.matcher, self.stopped = matcher, False

    def accept(self, token: int) -> bool:
        accepted = self.matcher.accept_token(token)
        self.stopped = self.matcher.is_terminated()
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.stopped = False


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        self.compiler = self.batch = None
        self.stop_bits: np.ndarray | None = None  # [num_words] int32: the stop tokens' bits

    def source(self, params: StructuredOutputsParams) -> xgrammar.Grammar:
        """The xgrammar Grammar of params; ValueError naming the field that is invalid (or that
        xgrammar lacks: whitespace_pattern)."""
        kind = params.kind
        if params.whitespace_pattern is not None:
            raise ValueError('structured_outputs.whitespace_pattern needs structured_outputs_config={"backend": '
                             '"guidance"} (xgrammar has no whitespace pattern)')
        try:
            if kind in ("json", "json_object"):
                return xgrammar.Grammar.from_json_schema(json.dumps(json_schema(params)),
                                                         any_whitespace=not params.disable_any_whitespace)
            if kind == "regex":
                return xgrammar.Grammar.from_regex(params.regex)
            if kind == "choice":
                return xgrammar.Grammar.from_ebnf(f"root ::= {choice_rule(params.choice)}")
            if "::=" in params.grammar:  # GBNF; else Lark
                return xgrammar.Grammar.from_ebnf(params.grammar)
            return xgrammar.Grammar.from_lark(params.grammar)
        except Exception as e:  # xgrammar raises RuntimeError, ValueError or its own errors
            raise ValueError(f"structured_outputs.{kind} is not valid: {e}") from None

    def setup(self):
        info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=self.eos_token_ids)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)  # GrammarCompiler caches
        self.batch = xgrammar.BatchGrammarMatcher()
        self.stop_bits = token_bits(self.eos_token_ids, -(-self.vocab_size // 32))

    def compile(self, grammar: xgrammar.Grammar) -> xgrammar.CompiledGrammar:
        return self.compiler.compile_grammar(grammar)

    def matcher(self, compiled: xgrammar.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgrammar.GrammarMatcher(compiled))

    def fill_bitmask(self, matchers: list[XGrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        self.batch.batch_fill_next_token_bitmask([m.matcher for m in matchers], bitmask, indices=rows)
        host = bitmask.numpy()
        for m, row in zip(matchers, rows):
            if m.matcher.is_completed() and not (host[row] & ~self.stop_bits).any():
                m.stopped = True  # nothing but a stop token may follow
