"""Speculative decoding's acceptance on real text: the demo model (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M
GGUF, nanovllm/loader/demo.py) on the CPU or GPU, greedy, on three kinds of prompt: editing given
code, summarising a given passage, and free chat. For each: the mean acceptance length (tokens per
verify run), per-position acceptance, the share of decode steps that verified drafts, tokens/s
with and without speculation on this machine, and a check that the outputs are the same. A fourth
prompt extracts JSON from a given text under a JSON schema (structured outputs).

    PYTHONPATH=. python benchmarks/spec_acceptance.py [--spec '{"method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_max": 4, "prompt_lookup_min": 2}'] [--max-tokens 160]
"""
import argparse
import json
import time

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.loader.demo import demo_model_path

CODE = '''def moving_average(values, window):
    result = []
    for i in range(len(values)):
        if i + 1 < window:
            result.append(None)
        else:
            total = 0
            for j in range(i + 1 - window, i + 1):
                total += values[j]
            result.append(total / window)
    return result
'''
PASSAGE = ("The Rhine is one of the major rivers of Europe. It begins in the Swiss canton of Graubunden in the "
           "southeastern Swiss Alps, forms part of the Swiss-Liechtenstein, Swiss-Austrian and Swiss-German borders, "
           "and then the Franco-German border, flows through the German Rhineland and the Netherlands, and empties "
           "into the North Sea at Rotterdam. The biggest city on the river Rhine is Cologne, Germany, with a "
           "population of more than 1,050,000 people. It is the second-longest river in Central and Western Europe, "
           "after the Danube, at about 1,230 km. The Rhine and the Danube formed most of the northern inland frontier "
           "of the Roman Empire, and since those days the Rhine has been a vital navigable waterway carrying trade "
           "and goods deep inland. Its importance as a waterway in the Holy Roman Empire is supported by the many "
           "castles and fortifications built along it.")
PROMPTS = {
    "code editing": f"Rename the function to `rolling_mean`, add type hints and a docstring, and keep the rest of "
                    f"the code as it is. Reply with the whole code.\n\n```python\n{CODE}```",
    "summary": f"Summarise this passage in three sentences, reusing its wording:\n\n{PASSAGE}",
    "free chat": "What are three good habits for someone learning to program? Answer briefly.",
    "JSON extraction": "Extract the order as JSON with name, age, sku, quantity and address: the customer Maria "
                       "Gonzalez, aged 34, ordered 3 units of product SKU-88412 to be shipped to 221 Baker Street, "
                       "London NW1 6XE.",
}
SCHEMAS = {"JSON extraction": {  # constrained: each draft's row masked by the grammar after the drafts before it
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "sku": {"type": "string"},
                                     "quantity": {"type": "integer"}, "address": {"type": "string"}},
    "required": ["name", "age", "sku", "quantity", "address"], "additionalProperties": False}}


def counts(llm) -> dict:
    return {m.name: getattr(m, "values", getattr(m, "value", None)) for m in llm.get_metrics()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", type=json.loads, default={"method": "ngram", "num_speculative_tokens": 4,
                                                        "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    path = demo_model_path()
    plain = LLM(path, device=args.device, max_model_len=2048)
    spec = LLM(path, device=args.device, max_model_len=2048, speculative_config=args.spec)
    print(f"speculative_config {json.dumps(args.spec)}; greedy, max_tokens {args.max_tokens}")
    for kind, prompt in PROMPTS.items():
        messages = [{"role": "user", "content": prompt}]
        schema = SCHEMAS.get(kind)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=schema and
                                StructuredOutputsParams(json=schema))
        before = counts(spec)
        t = time.perf_counter()
        ours = spec.chat(messages, params, use_tqdm=False)[0].outputs[0]
        spec_s = time.perf_counter() - t
        t = time.perf_counter()
        theirs = plain.chat(messages, params, use_tqdm=False)[0].outputs[0]
        plain_s = time.perf_counter() - t
        after = counts(spec)
        runs = after["vllm:spec_decode_num_drafts"] - before["vllm:spec_decode_num_drafts"]
        accepted = after["vllm:spec_decode_num_accepted_tokens"] - before["vllm:spec_decode_num_accepted_tokens"]
        per_pos = [(a - b) / max(runs, 1) for a, b in zip(after["vllm:spec_decode_num_accepted_tokens_per_pos"],
                                                          before["vllm:spec_decode_num_accepted_tokens_per_pos"])]
        n = len(ours.token_ids)
        print(f"{kind:>13}: {n} tokens, same as without speculation: {ours.token_ids == theirs.token_ids}; "
              f"{runs} verify runs over ~{n - accepted} steps; mean acceptance length "
              f"{1 + accepted / runs if runs else 0:.2f}; per position {[round(r, 2) for r in per_pos]}; "
              f"{n / spec_s:.1f} tok/s with speculation, {len(theirs.token_ids) / plain_s:.1f} without (this machine)")


if __name__ == "__main__":
    main()
