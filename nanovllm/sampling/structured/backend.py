"""The interface a grammar library implements for structured outputs, and what both share."""
import json
import threading
import time

import numpy as np
import torch

from nanovllm.sampling_params import StructuredOutputsParams


class Matcher:
    """One completion's position in its grammar, as the library's matcher: accept(token) -> False
    when the grammar does not allow the token (the matcher is then unusable); stopped: the grammar
    is complete and nothing but EOS may follow (or it has taken EOS); rollback(n) takes back the
    last n accepted tokens."""
    stopped: bool

    def accept(self, token: int) -> bool:
        raise NotImplementedError

    def rollback(self, num_tokens: int) -> None:
        raise NotImplementedError


class GrammarBackend:
    """A grammar library behind structured outputs, one per engine. tokenizer: the model's
    (Hugging Face, fast); vocab_size: the logits' width, which may exceed the tokenizer's (the
    columns past it are never allowed); eos_token_ids: the engine's, the only stop tokens a
    grammar allows (the libraries' own guesses are not used).

    source() runs on the caller's thread when a request is added: it turns a constraint into what
    compile() takes, or raises ValueError naming the field. compile() and the one-time tokenizer
    tables (ensure_setup()) run on the compile pool."""
    name: str

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self.setup_seconds: float | None = None  # the tokenizer tables' build time, once done
        self._lock = threading.Lock()

    def source(self, params: StructuredOutputsParams):
        raise NotImplementedError

    def ensure_setup(self) -> None:
        """Build the tokenizer tables the first time (on the pool: seconds on a large vocabulary)."""
        with self._lock:
            if self.setup_seconds is None:
                start = time.perf_counter()
                self.setup()
                self.setup_seconds = time.perf_counter() - start

    def setup(self) -> None:
        raise NotImplementedError

    def compile(self, source):
        """The compiled grammar of source, from which matcher() makes matchers (on the pool, after
        ensure_setup)."""
        raise NotImplementedError

    def matcher(self, compiled) -> Matcher:
        raise NotImplementedError

    def accept_tokens(self, matchers: list[Matcher], tokens: list[int]) -> list[bool]:
        """matchers[i].accept(tokens[i]) for every i (a step's one new token per completion)."""
        return [m.accept(t) for m, t in zip(matchers, tokens)]

    def fill_bitmask(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Write into rows of bitmask (host int32 [B, ceil(vocab_size / 32)], bit t of word w allows
        token 32 w + t) the tokens each matcher allows next, all rows at once on the library's threads."""
        raise NotImplementedError


def json_schema(params: StructuredOutputsParams) -> dict | bool:
    """params' JSON schema (json_object: any object); with disable_additional_properties, a json
    schema's object schemas that do not set additionalProperties get it false."""
    schema = params.schema()
    return _closed(schema) if params.disable_additional_properties and params.kind == "json" else schema


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "contains",
                  "propertyNames", "not", "if", "then", "else")  # a schema (items: also a list of them)


def _closed(schema):
    """schema with additionalProperties false on its object schemas that lack it, walked by
    keyword (a property named like a keyword stays a property)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    for key in (*_SCHEMA_LISTS, *_SCHEMA_VALUES):
        if key in out:
            out[key] = _closed(out[key])
    types = out.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types)
    if (is_object or "properties" in out or "patternProperties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def choice_rule(choices: list[str]) -> str:
    """The alternatives of a choice as grammar string literals (JSON escapes, which Lark and GBNF read)."""
    return " | ".join(json.dumps(c) for c in choices)


def token_bits(token_ids, num_words: int) -> np.ndarray:
    """A bitmask row (int32 [num_words]) allowing exactly token_ids."""
    bits = np.zeros(num_words * 32, bool)
    bits[list(token_ids)] = True
    return np.packbits(bits, bitorder="little").view(np.int32)
