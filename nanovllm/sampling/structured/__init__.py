"""Structured outputs (SamplingParams.structured_outputs): completions constrained by a JSON
schema, a regular expression, a list of choices or a context-free grammar.

A grammar library does the language work: llguidance ("guidance", guidance.py) or xgrammar
(xgrammar_backend.py), behind one small interface (backend.py). compiler.py validates each
distinct constraint when its request is added (a ValueError naming the field, before any work)
and compiles it once on a thread pool; state.py is one completion's matcher, fed its tokens;
processors/grammar_bitmask.py turns the matchers into the token bitmask that goes first among the
logits processors, and says how that keeps the engine's steps overlapped.

"auto" picks llguidance when it is installed: on Qwen's 151,936-token vocabulary its masks took
5 us at the median and 85-130 us on average along random walks through a realistic schema,
against xgrammar's 85 us and 660-700 us (2-core CPU); it builds a schema's grammar in ~1-12 ms
where xgrammar compiled the same schema in 2.8 s; it has no dependencies; it takes Lark and GBNF
grammars; and it says when a grammar is complete (only EOS may follow), so the completion ends
without sampling one more token. Both libraries guessed stop tokens wrong from a bare
tokenizer.json (xgrammar </s>, llguidance <|endoftext|> for Qwen's <|im_end|>): both are given
the engine's EOS ids instead.
"""
