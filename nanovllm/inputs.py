"""vLLM's prompt types (vllm.inputs), for generate: a TextPrompt is {"prompt": text}, a
TokensPrompt {"prompt_token_ids": ids}, optionally with the "prompt" text they came from."""
from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    prompt: str
