"""Structured outputs (SamplingParams.structured_outputs): completions constrained by a JSON
schema, a regular expression, a list of choices or a context-free grammar.

A grammar library does the language work: llguidance ("guidance", guidance.py) or xgrammar
(xgrammar_backend.py), behind one small interface (backend.py). compiler.py validates each
distinct constraint when its request is added (a ValueError naming the field, before any work)
and compiles it once on a thread pool; state.py is one completion's matcher, fed its tokens;
processors/grammar_bitmask.py turns the matchers into the token bitmask that goes first among the
logits processors, and says how that keeps the engine's steps overlapped.

"auto" picks llguidance when it is installed. Measured on a shared 2-core CPU with Qwen's
151,936-token vocabulary, along random walks through JSON schemas (what dummy weights sample):
with bounded strings (maxLength) its masks took 150 us on average against xgrammar's 520 us, and
it built each schema's grammar in ~1 ms where xgrammar compiled some for 0.9-2.8 s; on
benchmarks/structured.py's eight schemas at ~220 rows a step, it took 2.5 ms of host work per
step against xgrammar's 3.9 ms. It also has no dependencies, takes Lark and GBNF grammars, and
says when a grammar is complete (only EOS may follow), so the completion ends without sampling
one more token.

Both libraries guessed stop tokens wrong from a bare tokenizer.json (xgrammar </s>, llguidance
<|endoftext|> where Qwen's instruct models end with <|im_end|>): both get the engine's EOS ids.
"""
