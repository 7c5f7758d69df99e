"""The engine's grammars: each distinct structured_outputs constraint validated once, on the
thread that adds the request, and compiled once, on a thread pool off the engine's loop (the
scheduler starts a sequence once its grammar is compiled)."""
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

from nanovllm.sampling.structured.backend import GrammarBackend, Matcher
from nanovllm.sampling_params import StructuredOutputsParams

MAX_CACHED_GRAMMARS = 1024  # distinct constraints kept compiled; the oldest goes first


class Grammar:
    """One distinct constraint, validated; compiled on the pool from the first time the scheduler
    asks whether it is ready (so that a front end that only validates requests, as the
    data-parallel router, compiles nothing). compile_seconds: the compile's time, once ready (the
    backend's one-time tokenizer tables not included: backend.setup_seconds)."""

    def __init__(self, backend: GrammarBackend, source, pool: ThreadPoolExecutor):
        self.backend, self._source, self._pool = backend, source, pool
        self._future: Future | None = None  # of (compiled grammar, seconds)

    def _compiling(self) -> Future:
        if self._future is None:
            self._future = self._pool.submit(_compile, self.backend, self._source)
        return self._future

    @property
    def ready(self) -> bool:
        return self._compiling().done()

    @property
    def compile_seconds(self) -> float | None:
        return self._future.result()[1] if self.ready else None

    def wait(self) -> None:
        wait([self._compiling()])

    def matcher(self) -> Matcher:
        """A new matcher at the grammar's start, for one completion (waits for the compile)."""
        return self.backend.matcher(self._compiling().result()[0])


class GrammarCompiler:
    """backend: "guidance", "xgrammar", or None when neither library is installed; tokenizer,
    vocab_size, eos_token_ids: the model's (see GrammarBackend). The backend and the pool start
    with the first request that has structured outputs."""

    def __init__(self, backend: str | None, tokenizer, vocab_size: int, eos_token_ids):
        self.backend_name, self.tokenizer = backend, tokenizer
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids
        self.backend: GrammarBackend | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._grammars: dict[tuple, Grammar] = {}

    def get(self, params: StructuredOutputsParams) -> Grammar:
        """The Grammar of params (cached); ValueError naming the field when the constraint is
        invalid, or when the engine cannot serve structured outputs."""
        key = params.cache_key()
        grammar = self._grammars.get(key)
        if grammar is None:
            backend = self._backend()
            grammar = Grammar(backend, backend.source(params), self._pool)
            if len(self._grammars) >= MAX_CACHED_GRAMMARS:
                del self._grammars[next(iter(self._grammars))]
            self._grammars[key] = grammar
        return grammar

    def _backend(self) -> GrammarBackend:
        if self.backend is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer, and it has none")
            if self.backend_name == "guidance":
                from nanovllm.sampling.structured.guidance import GuidanceBackend as cls
            elif self.backend_name == "xgrammar":
                from nanovllm.sampling.structured.xgrammar_backend import XGrammarBackend as cls
            else:
                raise ValueError("structured_outputs needs a grammar library: pip install llguidance (or xgrammar)")
            self.backend = cls(self.tokenizer, self.vocab_size, self.eos_token_ids)
            self._pool = ThreadPoolExecutor(max(1, min(8, (os.cpu_count() or 2) // 2)),
                                            thread_name_prefix="nanovllm-grammar")
        return self.backend


def _compile(backend: GrammarBackend, source) -> tuple[object, float]:
    backend.ensure_setup()
    start = time.perf_counter()
    compiled = backend.compile(source)
    return compiled, time.perf_counter() - start
