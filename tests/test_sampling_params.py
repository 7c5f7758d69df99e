"""vLLM's SamplingParams fields and LLM/LLMEngine surface against references: transformers'
generate and log-softmax on the tiny models, the real demo tokenizer for text and stop strings."""
import json
import pickle
import shutil
import threading

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from nanovllm import LLM, LLMEngine, SamplingParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from nanovllm.sampling.inputs import sampling_tensors
from nanovllm.sampling.processors.bad_words import BadWords
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling_params import RequestOutputKind
from nanovllm.sequence import PLACEHOLDER, Sequence
from tests.conftest import hf_greedy, random_prompts

ARGS = dict(device="cpu", kvcache_block_size=16, max_model_len=128)


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(tiny_qwen3[0], **ARGS)


class PresenceFrequency(LogitsProcessor):
    """OpenAI's presence/frequency penalties over the completion (transformers has none built in)."""

    def __init__(self, prompt_len, presence, frequency):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores).scatter_add_(1, input_ids[:, self.prompt_len:],
                                                       torch.ones_like(input_ids[:, self.prompt_len:], dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def test_penalties_match_transformers(llm, tiny_qwen3):
    hf = tiny_qwen3[1]
    for base in random_prompts([7, 30], seed=31):
        prompt = base + hf_greedy(hf, base, 12)  # the greedy continuation repeats the prompt's tokens
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                              do_sample=False, repetition_penalty=8.0)[0, len(prompt):].tolist()
            ref_pf = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                                 do_sample=False, logits_processor=LogitsProcessorList(
                                     [PresenceFrequency(len(prompt), 2.0, 2.0)]))[0, len(prompt):].tolist()
        out = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                             repetition_penalty=8.0),
                                              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                             presence_penalty=2.0, frequency_penalty=2.0)],
                           use_tqdm=False)
        assert out[0].token_ids == ref and out[1].token_ids == ref_pf
        assert ref != hf_greedy(hf, prompt, 12) or ref_pf != hf_greedy(hf, prompt, 12)  # the penalties bite


def test_penalty_counts_survive_preemption_forks_and_mixed_batches(llm, tiny_qwen3):
    """The per-sequence token counts kept on the device (TokenCounts) give the same completions
    whether a sequence runs alone, beside unpenalised and differently penalised ones, forked
    (n=2, each child its own counts), or is preempted and rebuilt from its token ids."""
    prompts = random_prompts([30, 41, 25, 37], seed=36)
    greedy = dict(temperature=0, max_tokens=40, ignore_eos=True)
    params = [SamplingParams(**greedy, presence_penalty=1.5, frequency_penalty=0.5),
              SamplingParams(**greedy),
              SamplingParams(**greedy, repetition_penalty=3.0),
              SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=40, ignore_eos=True, frequency_penalty=1.0)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    together = llm.generate(prompts, params, use_tqdm=False)
    # 10 blocks of 16 tokens for five sequences of up to 81 tokens: they preempt one another
    tight = LLM(tiny_qwen3[0], **{**ARGS, "num_kvcache_blocks": 10})
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for a, b, c in zip(alone, together, squeezed):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs] == [o.token_ids for o in c.outputs]
    plain = llm.generate([prompts[0]], params[1], use_tqdm=False)[0]
    assert alone[0].token_ids != plain.token_ids  # the penalties bite


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_equal_the_log_softmax(tiny_qwen3, mode):
    path, hf = tiny_qwen3
    llm = LLM(path, logprobs_mode=mode, **ARGS)
    prompt = random_prompts([11], seed=32)[0]
    # raw logprobs ignore what processes the logits (a penalty here); processed ones follow temperature
    penalty = 2.0 if mode == "raw_logprobs" else 0.0
    params = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=5, logprobs=3, presence_penalty=penalty)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].float()
    ref = (logits / (0.8 if mode == "processed_logprobs" else 1.0)).log_softmax(-1)
    assert len(out.logprobs) == 6
    for step, token, lp in zip(out.logprobs, out.token_ids, ref):
        assert step[token].logprob == pytest.approx(lp[token].item(), abs=1e-4)
        assert step[token].rank == int((lp > lp[token]).sum()) + 1
        top = lp.topk(3)
        assert all(step[t].logprob == pytest.approx(v, abs=1e-4) and step[t].rank == r + 1
                   for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist())))
    assert out.cumulative_logprob == pytest.approx(sum(s[t].logprob for s, t in zip(out.logprobs, out.token_ids)))
    # the dicts are made when read: slices, negative indices and pickling (to other processes) see the same
    as_list = list(out.logprobs)
    assert out.logprobs[2:4] == as_list[2:4] and out.logprobs[-1] == as_list[-1]
    assert pickle.loads(pickle.dumps(out.logprobs)) == as_list and type(pickle.loads(pickle.dumps(out.logprobs))) is list


def test_token_masks(llm, tiny_qwen3):
    prompt = random_prompts([9], seed=33)[0]
    greedy = hf_greedy(tiny_qwen3[1], prompt, 8)
    outs = llm.generate([prompt] * 4, [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=[5, 7]),
        SamplingParams(temperature=0.9, max_tokens=8, ignore_eos=True, logit_bias={11: 100.0}),
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[greedy[0]], min_tokens=3),
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[greedy[0]]),
    ], use_tqdm=False)
    assert set(outs[0].token_ids) <= {5, 7}
    assert outs[1].token_ids == [11] * 8
    assert greedy[0] not in outs[2].token_ids[:3] and len(outs[2].token_ids) >= 3
    assert outs[3].token_ids == greedy[:1] and outs[3].outputs[0].stop_reason == greedy[0]


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, tiny_qwen3):
    long = random_prompts([200], seed=34)[0]  # longer than max_model_len=128
    params = dict(temperature=0, max_tokens=6, ignore_eos=True)
    out, = llm.generate([long], SamplingParams(truncate_prompt_tokens=20, **params), use_tqdm=False)
    assert out.prompt_token_ids == long[-20:] and out.token_ids == hf_greedy(tiny_qwen3[1], long[-20:], 6)
    out, = llm.generate([long], SamplingParams(truncate_prompt_tokens=-1, max_tokens=1), use_tqdm=False)
    assert out.prompt_token_ids == long[-128:] and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="the prompt has 200 tokens, more than max_model_len=128"):
        llm.generate([long], SamplingParams(**params), use_tqdm=False)


def test_bad_words_of_several_tokens_are_blocked_at_their_last_token():
    """A word's last token is banned in the rows whose completion ends with the rest of it, also
    where that completion's last token is still on the device (PLACEHOLDER), and where another
    word ending in the same token does not match."""
    x = torch.zeros(4, 10)
    x[:, 4] = 5.0  # token 4 is the argmax
    seqs = [Sequence([7], SamplingParams(temperature=0, bad_words=["w"])) for _ in range(4)]
    for seq, completion in zip(seqs, ([1, 2], [2, 1], [1, PLACEHOLDER], [3, 1, 2])):
        seq.token_ids += completion
        seq.bad_words_ids = [[1, 2, 4], [9, 4]]
    processors = [BadWords(10, frozenset(), torch.device("cpu"))]
    st = sampling_tensors(seqs, torch.device("cpu"), processors, {seqs[2].seq_id: 1}, torch.tensor([0, 2]), 10)
    assert Sampler()(x, st)[0].tolist() == [0, 4, 0, 0]  # where 4 is banned the rest tie at 0


def test_step_api_streams_and_aborts(tiny_qwen3):
    engine = LLMEngine.from_engine_args(tiny_qwen3[0], **ARGS)
    prompts = random_prompts([5, 8, 12], seed=34)
    base = dict(temperature=0, max_tokens=10, ignore_eos=True)
    engine.add_request("cum", prompts[0], SamplingParams(**base))
    engine.add_request("delta", prompts[1], SamplingParams(**base, output_kind=RequestOutputKind.DELTA))
    engine.add_request("gone", prompts[2], SamplingParams(**base))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("cum", prompts[0], SamplingParams())
    seen, steps = {"cum": [], "delta": [], "gone": []}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
        steps += 1
        if steps == 4:
            engine.abort_request("gone")
    assert [o.token_ids for o in seen["cum"]] == [seen["cum"][-1].token_ids[:i + 1] for i in range(10)]
    assert sum((o.token_ids for o in seen["delta"]), []) == hf_greedy(tiny_qwen3[1], prompts[1], 10)
    assert seen["cum"][-1].finished and seen["delta"][-1].finished and not any(o.finished for o in seen["gone"])
    assert engine.block_manager.num_free_blocks == engine.model_runner.num_kvcache_blocks


def test_an_id_reused_after_its_abort_gets_only_the_new_requests_outputs(tiny_qwen3):
    """The step launched before the abort still holds the aborted request's rows; read after the
    id names a new request, they must not become its tokens or prompt logprobs."""
    engine = LLMEngine.from_engine_args(tiny_qwen3[0], **ARGS)
    old, new = random_prompts([30, 9], seed=35)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    alone = LLMEngine.from_engine_args(tiny_qwen3[0], **ARGS)
    alone.add_request("x", new, params)
    expected = []
    while alone.has_unfinished_requests():
        expected += alone.step()
    engine.add_request("x", old, params)
    engine.step()
    engine.abort_request("x")
    engine.add_request("x", new, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3, 4]
    assert outputs[-1].outputs[0].token_ids == expected[-1].outputs[0].token_ids
    assert outputs[-1].prompt_logprobs == expected[-1].prompt_logprobs and len(outputs[-1].prompt_logprobs) == 9


def test_aborting_a_waiting_request_leaves_the_others(tiny_qwen3):
    """A request aborted while it waits behind others leaves the queue alone: the others finish."""
    engine = LLMEngine.from_engine_args(tiny_qwen3[0], **ARGS)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for rid, prompt in zip("abc", random_prompts([4, 6, 8], seed=36)):
        engine.add_request(rid, prompt, params)
    engine.abort_request("b")  # second in the queue
    finished = {}
    for _ in range(40):
        finished |= {out.request_id: len(out.outputs[0].token_ids) for out in engine.step() if out.finished}
        if not engine.has_unfinished_requests():
            break
    assert finished == {"a": 5, "c": 5} and not engine.has_unfinished_requests()


def test_two_threads_get_their_own_completions(llm, tiny_qwen3):
    prompts = [random_prompts([n], seed=35 + n)[0] for n in (6, 13)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [[o.token_ids for o in llm.generate([p] * 3, params, use_tqdm=False)] for p in prompts]
    results = [None, None]

    def run(i):
        results[i] = [o.token_ids for o in llm.generate([prompts[i]] * 3, params, use_tqdm=False)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected


def test_generation_config_gives_the_defaults(tiny_qwen3, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(tiny_qwen3[0], path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20, "top_p": 0.95}))
    defaults = LLM(str(path), **ARGS).get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.6, 20, 0.95)
    assert LLM(str(path), generation_config="vllm", **ARGS).get_default_sampling_params() == SamplingParams()


def test_generation_configs_eos_ids_end_completions(llm, tiny_qwen3, tmp_path):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    stop = tokens[2]
    path = tmp_path / "m"
    shutil.copytree(tiny_qwen3[0], path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop]}))
    for generation_config in ("auto", "vllm"):  # vLLM stops at them whatever its generation_config
        engine = LLM(str(path), generation_config=generation_config, **ARGS)
        out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == tokens[:tokens.index(stop) + 1] and out.finish_reason == "stop"
        assert engine.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids == tokens


def test_prompt_logprobs_equal_the_log_softmax(tiny_qwen3):
    """A 50-token prompt prefilled in chunks of at most 24 tokens: every prompt token after the
    first gets its raw logprob, rank and top 2 from the logits of the token before it; a second
    request for the same prompt is not served from the prefix cache (it would have no logits)."""
    path, hf = tiny_qwen3
    llm = LLM(path, max_num_batched_tokens=24, **ARGS)
    prompt = random_prompts([50], seed=38)[0]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, n=2)
    first, second = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    lps = first.prompt_logprobs
    assert lps[0] is None and len(lps) == len(prompt) and second.num_cached_tokens == 0
    for pos, (step, lp) in enumerate(zip(lps[1:], ref), start=1):
        token = prompt[pos]
        assert step[token].logprob == pytest.approx(lp[token].item(), abs=1e-4)
        assert step[token].rank == int((lp > lp[token]).sum()) + 1
        top = lp.topk(2)
        assert all(step[t].rank == r + 1 and step[t].logprob == pytest.approx(v, abs=1e-4)
                   for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist())))
    assert [{t: x.logprob for t, x in d.items()} for d in second.prompt_logprobs[1:]] == \
        [{t: x.logprob for t, x in d.items()} for d in lps[1:]]


def test_n_completions_share_one_prefill(tiny_qwen3):
    """n greedy completions each equal transformers' (the forked KV is right, for a prompt ending
    inside a block and one filling its blocks), and the prompt is prefilled once."""
    path, hf = tiny_qwen3
    engine = LLMEngine.from_engine_args(path, enable_prefix_caching=False, **ARGS)
    prompts = random_prompts([21, 32], seed=36)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(n=3, temperature=0, max_tokens=7, ignore_eos=True,
                                                     output_kind=RequestOutputKind.FINAL_ONLY))
    outputs, prefill = {}, 0
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
        prefill += engine.num_prefill_tokens
    assert prefill == sum(map(len, prompts))
    for i, p in enumerate(prompts):
        assert [c.index for c in outputs[str(i)].outputs] == [0, 1, 2]
        assert all(c.token_ids == hf_greedy(hf, p, 7) for c in outputs[str(i)].outputs)
    assert engine.block_manager.num_free_blocks == engine.model_runner.num_kvcache_blocks


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.001 (z: the normal one), by Wilson and Hilferty (1931)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_n_samples_follow_the_distribution(tiny_qwen3):
    """1,500 completions of one prompt (more than max_num_seqs: the rest wait and prefill on their
    own): their first tokens pass a chi-square test against softmax(logits / T); seeded, the
    request repeats exactly."""
    path, hf = tiny_qwen3
    llm = LLM(path, max_num_seqs=64, **ARGS)
    prompt = random_prompts([13], seed=37)[0]
    out = llm.generate([prompt], SamplingParams(n=1500, temperature=1.5, max_tokens=1), use_tqdm=False)[0]
    assert len(out.outputs) == 1500 and out.finished
    with torch.no_grad():
        probs = (hf(torch.tensor([prompt])).logits[0, -1].float() / 1.5).softmax(-1)
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in out.outputs]), minlength=len(probs)).float()
    expected = probs * 1500
    big = expected >= 5  # the rest pooled into one category
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    stat = ((observed - expected) ** 2 / expected).sum().item()
    assert big.sum() > 5 and stat < chi_square_critical(len(observed) - 1), stat
    seeded = SamplingParams(n=5, temperature=1.0, max_tokens=8, seed=9, ignore_eos=True)
    first, again = (llm.generate([prompt], seeded, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 5


# ---- text: the demo model's real (Qwen2.5) tokenizer ----------------------------------------

@pytest.fixture(scope="module")
def demo():
    from nanovllm.loader.demo import demo_model_path
    return LLM(demo_model_path(), device="cpu", max_model_len=256, kvcache_block_size=16)


def test_incremental_detokenizer_keeps_multibyte_characters_whole(demo):
    tok = demo.tokenizer
    text = "Größe: 龘龘 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 — 你好, wörld! 🎉🎉"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some characters really are split over tokens
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"), True, True)
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == detok.text == tok.decode(ids) and not any("\ufffd" in p for p in pieces)
    assert find_stop_string(detok.text, 3, ("🎉",)) == ("🎉", len(text) - 2)


def test_a_character_cut_short_is_left_out_of_the_text_with_or_without_stop_strings(demo):
    """max_tokens ends the completion inside a character: the whole-completion decode (no stop
    strings) leaves it out as the incremental one (stop strings) does."""
    tok = demo.tokenizer
    pieces = (tok.encode(c, add_special_tokens=False)[0] for c in "𝔘龘🦩𓀀")
    first = next(t for t in pieces if tok.decode([t]) == "\ufffd")  # a piece of a character
    texts = [demo.generate([tok.encode("Say:")], SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=[first],
                                                                **stop), use_tqdm=False)[0].outputs[0].text
             for stop in ({}, {"stop": ["@@@"]})]
    assert texts == ["", ""]


def test_chat_refuses_a_message_without_role_or_content(demo):
    """Qwen's template would drop such a message silently and answer the system prompt alone."""
    for bad in ({"content": "no role"}, {"role": "user"}, "just text"):
        with pytest.raises(ValueError, match="conversation 0, message 1: a message is a dict with"):
            demo.chat([{"role": "user", "content": "hi"}, bad], use_tqdm=False)
    assert demo.engine.scheduler.is_finished()


def test_stop_strings_cut_the_text(demo):
    messages = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    free = demo.chat(messages, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    ids = demo.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert free.prompt_token_ids == list(getattr(ids, "input_ids", ids))  # chat = the template's ids
    text = free.text
    stop = text[text.index("5"):text.index("5") + 4]  # e.g. "5, 6": spans several tokens
    for include in (False, True):
        out = demo.chat(messages, SamplingParams(temperature=0, max_tokens=40, stop=[stop, "never"],
                                                 include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[:text.index(stop) + (len(stop) if include else 0)]
        assert demo.tokenizer.decode(out.token_ids).startswith(text[:text.index(stop) + len(stop)])


def test_streams_never_take_text_back_and_finish_once(demo):
    """LLMEngine.step's CUMULATIVE and DELTA outputs with a stop string that spans several tokens:
    each cumulative text a prefix of the final one, the deltas adding up to it (the last few
    characters, where a stop string may yet complete, held back until then), and finish_reason set
    in the last output only, as vLLM's (a request that reaches max_tokens ends when its last
    step is launched, one output before that token is read back)."""
    messages = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    ids = demo.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(getattr(ids, "input_ids", ids))
    text = demo.generate([ids], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0].text
    stop = text[text.index("5"):text.index("5") + 4]  # e.g. "5, 6": spans several tokens
    cases = [(dict(stop=[stop]), "stop", text[:text.index(stop)]), (dict(max_tokens=6), "length", None)]
    for extra, reason, final in cases:
        for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
            engine = demo.llm_engine
            engine.add_request("s", ids, SamplingParams(**{"temperature": 0, "max_tokens": 40, **extra},
                                                        output_kind=kind))
            outs = []
            while engine.has_unfinished_requests():
                outs += [out.outputs[0] for out in engine.step()]
            texts = [o.text for o in outs]
            whole = texts[-1] if kind == RequestOutputKind.CUMULATIVE else "".join(texts)
            assert whole == (final if final is not None else demo.tokenizer.decode(
                sum((o.token_ids for o in outs), []) if kind == RequestOutputKind.DELTA else outs[-1].token_ids))
            if kind == RequestOutputKind.CUMULATIVE:
                assert all(whole.startswith(t) for t in texts), (extra, texts)
            assert [o.finish_reason for o in outs] == [None] * (len(outs) - 1) + [reason], (extra, kind)


def test_stop_token_text_is_left_out_unless_asked_for(demo):
    """As vLLM's detokenizer: a completion ended by one of stop_token_ids, or by EOS, keeps the
    token in token_ids but not its text in text, unless include_stop_str_in_output."""
    messages = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    free = demo.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    stop = next(t for t in free.token_ids[3:] if demo.tokenizer.decode([t]).strip())  # a token with visible text
    first = free.token_ids.index(stop)
    # text decoded at the end, or token by token (a stop string that never comes needs the latter)
    for include, strings in ((False, None), (True, None), (False, ["zzz"]), (True, ["zzz"])):
        out = demo.chat(messages, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop], stop=strings,
                                                 include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == free.token_ids[:first + 1] and out.stop_reason == stop
        assert out.text == demo.tokenizer.decode(out.token_ids if include else out.token_ids[:-1])
    for strings in (None, ["zzz"]):
        out = demo.chat([{"role": "user", "content": "Say hi."}], SamplingParams(
            temperature=0, max_tokens=32, skip_special_tokens=False, stop=strings), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason is None
        assert demo.tokenizer.decode(out.token_ids[-1:], skip_special_tokens=False)  # EOS has text here
        assert out.text == demo.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=False)


def test_chat_takes_text_parts_and_tools(demo):
    """OpenAI-style content parts become one string (vLLM joins text parts with newlines); other
    parts are refused by name; tools reach the template."""
    params = SamplingParams(temperature=0, max_tokens=4)
    plain = demo.chat([{"role": "user", "content": "Say hi.\nBriefly."}], params, use_tqdm=False)[0]
    parts = demo.chat([{"role": "user", "content": [{"type": "text", "text": "Say hi."},
                                                    {"type": "text", "text": "Briefly."}]}], params, use_tqdm=False)[0]
    assert parts.prompt_token_ids == plain.prompt_token_ids and parts.token_ids == plain.token_ids
    with pytest.raises(ValueError, match="conversation 0, message 0: content parts must be text"):
        demo.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}], params,
                  use_tqdm=False)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    out = demo.chat([{"role": "user", "content": "Weather in Paris?"}], params, tools=[tool], use_tqdm=False)[0]
    assert "get_weather" in out.prompt and "get_weather" not in plain.prompt
    # vLLM's ways to say the same: tools among chat_template_kwargs; text parts in "string" format
    kwargs = demo.chat([{"role": "user", "content": "Weather in Paris?"}], params,
                       chat_template_kwargs={"tools": [tool]}, use_tqdm=False)[0]
    assert kwargs.prompt == out.prompt
    string = demo.chat([{"role": "user", "content": [{"type": "text", "text": "Say hi."},
                                                     {"type": "text", "text": "Briefly."}]}],
                       params, chat_template_content_format="string", use_tqdm=False)[0]
    assert string.prompt_token_ids == plain.prompt_token_ids
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                                  "arguments": {"city": "Paris"}}}]}
    turns = demo.chat([{"role": "user", "content": "Weather in Paris?"}, call,
                       {"role": "tool", "content": "sunny"}], params, tools=[tool], use_tqdm=False)[0]
    assert '"city": "Paris"' in turns.prompt and "sunny" in turns.prompt  # a call without content (OpenAI's)
    with pytest.raises(ValueError, match="messages must be a conversation .* got str"):
        demo.chat("Weather in Paris?", params)
    with pytest.raises(ValueError, match="chat_template_content_format must be"):
        demo.chat([{"role": "user", "content": "hi"}], params, chat_template_content_format="json")


def test_clone_is_a_deep_copy():
    params = SamplingParams(stop=["a"], logit_bias={1: 2.0})
    copy = params.clone()
    copy.logit_bias[1] = 0.0
    assert params.logit_bias == {1: 2.0} and copy == SamplingParams(stop=["a"], logit_bias={1: 0.0})


def test_from_optional_gives_defaults_for_none_where_a_field_takes_none():
    params = SamplingParams.from_optional(n=None, temperature=None, top_k=None, max_tokens=None, seed=None,
                                          top_p=0.5, logit_bias={"5": 300, 7: -0.5})
    assert params == SamplingParams(max_tokens=None, top_p=0.5, logit_bias={5: 100.0, 7: -0.5})
    assert SamplingParams.from_optional() == SamplingParams()
    with pytest.raises(TypeError, match="tempreature"):
        SamplingParams.from_optional(tempreature=0.5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.from_optional(temperature=-1.0)


def test_tiny_temperatures_are_raised_to_the_least_that_does_not_overflow(llm, caplog):
    with caplog.at_level("WARNING"):
        params = SamplingParams(temperature=1e-40, seed=3, max_tokens=12, ignore_eos=True)
    assert params.temperature == 0.01 and "below 0.01" in caplog.text
    least = SamplingParams(temperature=0.01, seed=3, max_tokens=12, ignore_eos=True)
    outs = llm.generate([[5, 6, 7]] * 2, [params, least], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
