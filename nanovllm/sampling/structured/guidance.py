"""llguidance (Microsoft's Guidance engine, https://github.com/guidance-ai/llguidance) behind
structured outputs: its grammars are built lazily, so "compiling" a schema is parsing it (ms),
and each mask is computed from the lexer's state over a token trie, in Rust, on its own threads."""
import os

import llguidance
import llguidance.hf
import torch

from nanovllm.sampling.structured.backend import GrammarBackend, Matcher, choice_rule, json_schema
from nanovllm.sampling_params import StructuredOutputsParams


class GuidanceMatcher(Matcher):
    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        return self.matcher.consume_token(token)

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)


class GuidanceBackend(GrammarBackend):
    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"structured outputs with llguidance need a fast (Rust) tokenizer; this model's is "
                             f"{type(tokenizer).__name__}")
        self.ll_tokenizer = self.executor = None
        # a step's tokens taken on the library's threads pays with many cores, 207 rows: 0.59 against
        # 0.90 ms one by one on a 16-core host; 0.75 against 0.59 ms on 2 cores (benchmarks/structured.py)
        self.parallel_accept = (os.cpu_count() or 1) >= 8

    def source(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar (its JSON text) of params; ValueError naming the field that is invalid."""
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                options = {"whitespace_flexible": not params.disable_any_whitespace}
                if params.whitespace_pattern is not None:
                    options["whitespace_pattern"] = params.whitespace_pattern
                grammar = llguidance.LLMatcher.grammar_from_json_schema(json_schema(params), defaults=options)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(params.regex)
            elif kind == "choice":
                grammar = llguidance.LLMatcher.grammar_from_lark(f"start: {choice_rule(params.choice)}")
            else:  # Lark, or GBNF (rules written name ::= ...), which llguidance converts to Lark
                grammar = llguidance.grammar_from("grammar", params.grammar)
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
            if failed:
                raise ValueError(messages[0].strip())
        except ValueError as e:
            pattern = " (with whitespace_pattern)" if params.whitespace_pattern and kind.startswith("json") else ""
            raise ValueError(f"structured_outputs.{kind}{pattern} is not valid: {e}") from None
        return grammar

    def setup(self):
        self.ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids)
        self.executor = llguidance.LLExecutor()

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"llguidance could not build the grammar: {matcher.get_error()}")
        return matcher  # each completion's matcher is a copy of this one at the start

    def matcher(self, compiled: llguidance.LLMatcher) -> GuidanceMatcher:
        return GuidanceMatcher(compiled.deep_copy())

    def accept_tokens(self, matchers: list[GuidanceMatcher], tokens: list[int]) -> list[bool]:
        if not self.parallel_accept:
            return super().accept_tokens(matchers, tokens)
        return self.executor.consume_token_par([(m.matcher, t) for m, t in zip(matchers, tokens)])

    def fill_bitmask(self, matchers: list[GuidanceMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        # llguidance.torch.fill_next_token_bitmask_par without importing llguidance.torch, whose
        # torch.compile decorator takes seconds to import
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
        self.executor.unsafe_compute_mask_ptr([(m.matcher, row) for m, row in zip(matchers, rows)],
                                              bitmask.data_ptr(), bitmask.size(1) * 4, bitmask.size(0))
