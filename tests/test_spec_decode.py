"""Speculative decoding (speculative_config): the n-gram proposer against a brute-force search; greedy
outputs, logprobs and finish reasons with speculation equal those without it, token for token
(repetitive and random prompts, chunked prefill, forced preemption, n > 1, tensor parallelism);
stops and max_tokens inside accepted runs; sampled tokens keep the target's distribution (a
chi-square test against transformers' probabilities); bad configurations fail up front."""
import gc

import numpy as np
import pytest
import torch
from scipy.stats import chi2
from transformers import Qwen3Config, Qwen3ForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.engine.spec_decode.ngram import ngram_drafts
from tests.conftest import COMMON, TINY, random_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ARGS = dict(device="cpu", kvcache_block_size=16)


def brute_force_drafts(history: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The k tokens after the earliest occurrence of the longest suffix n-gram (vLLM's rule), by search."""
    for n in range(min(max_n, len(history) - 1), min_n - 1, -1):
        for end in range(n - 1, len(history) - 1):
            if history[end - n + 1:end + 1] == history[-n:]:
                return history[end + 1:end + 1 + k]
    return []


def test_ngram_drafts_match_a_brute_force_search():
    rng = np.random.default_rng(0)
    for trial in range(40):  # small vocabularies make many matches, of every length
        vocab = int(rng.integers(2, 6))
        histories = [rng.integers(0, vocab, int(rng.integers(1, 40))) for _ in range(int(rng.integers(1, 6)))]
        min_n, max_n = sorted(int(x) for x in rng.integers(1, 5, 2))
        k = int(rng.integers(1, 6))
        ours = ngram_drafts(histories, min_n, max_n, k)
        assert ours == [brute_force_drafts(h.tolist(), min_n, max_n, k) for h in histories], trial
    # vLLM's docstring example: [4, 2, 3] has no earlier match, [2, 3] has; 3 tokens follow it
    assert ngram_drafts([np.array([1, 2, 3, 4, 2, 3])], 2, 3, 4) == [[4, 2, 3]]


def repetitive_prompts():
    loop = [5, 9, 14, 2, 77, 31]
    return [loop * 6, [1, 2, 3] * 10 + [8], random_prompts([40], seed=2)[0] * 2]


def outputs(llm, prompts, params):
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


def num_accepted(llm) -> int:
    return next(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens")


REPLAY = {"method": "replay", "acceptance_rate": 0.7, "num_speculative_tokens": 4}


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 40},  # prompts prefilled in chunks beside verify runs
    {"num_kvcache_blocks": 9, "max_model_len": 128},  # preemptions
])
def test_greedy_outputs_with_speculation_equal_plain_outputs(tiny_model, engine_args):
    """n-gram drafts (on random models mostly wrong) and replayed ones (70% right, in the second
    run: the first records), each against the plain engine's tokens."""
    path, _ = tiny_model
    prompts = repetitive_prompts() + random_prompts([7, 23, 60], seed=3)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2)
    expected = outputs(LLM(path, **ARGS, **engine_args), prompts, params)
    for spec_config, runs in ((NGRAM, 1), (REPLAY, 2)):
        spec = LLM(path, **ARGS, **engine_args, speculative_config=spec_config)
        for _ in range(runs):
            assert outputs(spec, prompts, params) == expected
        assert num_accepted(spec) > (0 if spec_config is NGRAM else 50)
        assert spec.engine.spec_metrics.num_draft_tokens > num_accepted(spec)  # drafts rejected too
        if "num_kvcache_blocks" in engine_args:
            assert spec.engine.scheduler.num_preemptions > 0
        assert spec.engine.block_manager.num_free_blocks == spec.engine.model_runner.num_kvcache_blocks


def test_uniform_verify_steps_pad_every_decode_to_k_drafts(tiny_qwen3):
    """With CUDA graphs (uniform, forced here) every decoding row of a speculative step verifies
    exactly k drafts: where one cannot (near its max_tokens, or with a penalty), or the step's
    budget cannot hold them all, none does, so that no step runs eagerly; the tokens stay the
    plain engine's."""
    path, _ = tiny_qwen3
    prompts, k, max_tokens = repetitive_prompts() + random_prompts([7, 23], seed=3), NGRAM["num_speculative_tokens"], 40
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    spec = LLM(path, **ARGS, speculative_config=NGRAM)
    spec.engine.speculator.uniform = True
    steps, run = [], spec.engine.model_runner.run
    spec.engine.model_runner.run = lambda scheduled, forks, copies, drafts: (
        steps.append([(n, s.num_computed_tokens - s.num_prompt_tokens) for s, n in scheduled] if drafts else None)
        or run(scheduled, forks, copies, drafts))
    assert outputs(spec, prompts, params) == outputs(LLM(path, **ARGS), prompts, params)
    verify_steps = [step for step in steps if step]
    assert len(verify_steps) > 10
    assert all(n == 1 + k for step in verify_steps for n, _ in step)
    steps.clear()
    penalised = [params] * (len(prompts) - 1) + [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                                presence_penalty=0.5)]
    assert outputs(spec, prompts, penalised) == outputs(LLM(path, **ARGS), prompts, penalised)
    first = next(i for i, step in enumerate(steps) if step)  # none while the penalised one decodes
    assert first >= 10 and all(n == 1 + k for step in steps if step for n, _ in step)
    steps.clear()
    spec.engine.speculator.budget = len(prompts) * (1 + k) - 1  # five sequences' verify runs do not fit
    assert outputs(spec, prompts, params) == outputs(LLM(path, **ARGS), prompts, params)
    assert not any(steps)


def test_stops_max_tokens_and_logprobs_inside_accepted_runs(tiny_qwen3):
    """Replayed runs (acceptance 1: every draft right) put each stop and each max_tokens inside a
    run; the outputs end exactly where the plain run's do, with the same logprobs."""
    path, _ = tiny_qwen3
    prompts = random_prompts([6, 13, 30], seed=21)
    plain = LLM(path, **ARGS)
    spec = LLM(path, **ARGS, speculative_config={"method": "replay", "acceptance_rate": 1.0,
                                                 "num_speculative_tokens": 4})
    record = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    refs = [o[0][0] for o in outputs(spec, prompts, record)]  # recorded for the replay
    assert refs == [o[0][0] for o in outputs(plain, prompts, record)]
    for j in (3, 5, 6, 11):  # the stop token: each prompt's completion token j, at its first occurrence
        for p, ref in zip(prompts, refs):
            params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ref[j]], ignore_eos=True, logprobs=2)
            ours, theirs = spec.generate([p], params, use_tqdm=False)[0], plain.generate([p], params, use_tqdm=False)[0]
            first = ref.index(ref[j])
            assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids == ref[:first + 1]
            assert ours.outputs[0].stop_reason == ref[j]
            for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True):
                assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    for max_tokens in range(1, 12):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert [o[0][0] for o in outputs(spec, prompts, params)] == [r[:max_tokens] for r in refs]
    metrics = {m.name: m for m in spec.get_metrics()}
    assert metrics["vllm:spec_decode_num_accepted_tokens"].value == metrics["vllm:spec_decode_num_draft_tokens"].value > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values[0] == metrics["vllm:spec_decode_num_drafts"].value


def test_replay_acceptance_rate_is_the_chosen_one(tiny_qwen3):
    path, _ = tiny_qwen3
    spec = LLM(path, **ARGS, speculative_config={"method": "replay", "acceptance_rate": 0.6,
                                                 "num_speculative_tokens": 3})
    prompts, params = random_prompts([5] * 8, seed=9), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    refs = outputs(spec, prompts, params)
    assert outputs(spec, prompts, params) == refs
    m = spec.engine.spec_metrics
    rates = m.acceptance_rates()  # 0.6, 0.36, 0.216 expected, over a few hundred runs
    assert m.num_drafts > 200 and all(abs(r - 0.6 ** (i + 1)) < 0.07 for i, r in enumerate(rates)), rates


def test_seeded_sampling_with_penalties_and_min_tokens_still_holds(tiny_qwen3):
    """Rows with logits processors decode without drafts beside verify runs; seeded rows repeat."""
    path, _ = tiny_qwen3
    prompts = repetitive_prompts()
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, presence_penalty=0.7, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, min_tokens=15, max_tokens=20)]
    plain, spec = LLM(path, **ARGS), LLM(path, **ARGS, speculative_config=NGRAM)
    assert outputs(spec, prompts, params)[1:] == outputs(plain, prompts, params)[1:]
    first = outputs(spec, prompts, params)[0]
    assert first == outputs(spec, prompts, params)[0]  # seeded: the same tokens again


def test_no_speculation_while_more_requests_than_disable_by_batch_size(tiny_qwen3):
    """5 requests with disable_by_batch_size 4: no proposals until one has finished, then runs follow."""
    path, _ = tiny_qwen3
    spec = LLM(path, **ARGS, speculative_config=REPLAY | {"disable_by_batch_size": 4})
    prompts = random_prompts([5, 8, 11, 14, 17], seed=6)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 30, 30, 30, 30)]
    outputs(spec, prompts, params)  # records
    engine, proposals = spec.engine, []
    propose = engine.speculator.proposer.propose
    engine.speculator.proposer.propose = lambda seqs: proposals.append(len(engine.requests)) or propose(seqs)
    assert outputs(spec, prompts, params) == outputs(LLM(path, **ARGS), prompts, params)
    assert proposals and max(proposals) == 4 and num_accepted(spec) > 0


def test_steps_without_proposals_back_off_to_overlapped_steps(tiny_qwen3):
    """A proposer that finds nothing is asked at steps 1, 3, 6, 11, 16, ... (skips of 1, 2, then
    MAX_IDLE_SKIP overlapped steps); once it proposes, it is asked every step again."""
    path, _ = tiny_qwen3
    spec = LLM(path, **ARGS, speculative_config=NGRAM)
    asked, steps = [], [0]
    spec.engine.speculator.proposer.propose = lambda seqs: asked.append(steps[0]) or [[]] * len(seqs)
    step = spec.engine.step
    spec.engine.step = lambda: steps.__setitem__(0, steps[0] + 1) or step()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert outputs(spec, random_prompts([9]), params) == outputs(LLM(path, **ARGS), random_prompts([9]), params)
    assert asked == [2, 4, 7, 12, 17, 22, 27]  # step 1 prefills: nothing decodes yet
    asked.clear()
    spec.engine.speculator.proposer.propose = lambda seqs: asked.append(steps[0]) or [[1]] * len(seqs)
    outputs(spec, random_prompts([9]), params)
    assert len(asked) > 8 and asked == list(range(asked[0], asked[0] + len(asked)))


def tiny_vocab_model(tmp_path, vocab, seed=5):
    torch.manual_seed(seed)
    config = Qwen3Config(**COMMON | TINY["qwen3"][2] | {"vocab_size": vocab, "initializer_range": 0.6})
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    return str(tmp_path), model


def exact_joint(model, prompt, vocab, depth):
    """transformers' probabilities of every continuation of `depth` tokens [vocab ** depth], float64."""
    probs = np.ones(1)
    for d in range(depth):
        seqs = [prompt + list(np.unravel_index(i, (vocab,) * d)) for i in range(vocab ** d)] if d else [prompt]
        with torch.no_grad():
            last = model(torch.tensor(seqs)).logits[:, -1].double().softmax(-1).numpy()
        probs = (probs[:, None] * last).reshape(-1)
    return probs


def test_sampled_tokens_keep_the_target_distribution(tmp_path):
    """Pearson's chi-square of the first three sampled tokens (4^3 cells; the 2nd and 3rd come from
    verify runs, accepted or not) against transformers' exact probabilities, with and without
    n-gram speculation; seeded requests, so the test is deterministic."""
    vocab, depth, num = 4, 3, 3000
    path, model = tiny_vocab_model(tmp_path, vocab)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 3, 2, 0, 1]
    expected = exact_joint(model, prompt, vocab, depth) * num
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=6, ignore_eos=True) for i in range(num)]
    for spec in (None, NGRAM | {"disable_by_batch_size": None}):
        llm = LLM(path, **ARGS, max_num_seqs=512, speculative_config=spec)
        counts = np.zeros(vocab ** depth)
        for out in llm.generate([prompt] * num, params, use_tqdm=False):
            counts[np.ravel_multi_index(out.outputs[0].token_ids[:depth], (vocab,) * depth)] += 1
        small = expected < 5  # pooled, as the test needs
        obs = np.append(counts[~small], counts[small].sum())
        exp = np.append(expected[~small], expected[small].sum())
        stat = ((obs - exp) ** 2 / exp).sum()
        assert chi2.sf(stat, len(obs) - 1) > 1e-3, (spec, stat)
        if spec:
            assert 200 < num_accepted(llm) < llm.engine.spec_metrics.num_draft_tokens  # some taken, some not


def test_tensor_parallel_with_ngram_speculation(tiny_qwen3):
    path, _ = tiny_qwen3
    prompts = repetitive_prompts() + random_prompts([9, 30], seed=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    args = ARGS | dict(max_model_len=128, max_num_batched_tokens=48)
    spec = LLM(path, **args, tensor_parallel_size=2, speculative_config=NGRAM)
    assert outputs(spec, prompts, params) == outputs(LLM(path, **args), prompts, params)
    assert num_accepted(spec) > 10


@pytest.mark.parametrize("spec,error", [
    ({"num_speculative_tokens": 3}, "needs a method"),
    ({"method": "medusa", "num_speculative_tokens": 3}, "'medusa' is not supported"),
    ({"method": "ngram"}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys \\['lookahead'\\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_rate": 0.5}, "acceptance_rate"),
    ({"method": "replay", "num_speculative_tokens": 2}, "acceptance_rate"),
    ({"method": "replay", "num_speculative_tokens": 2, "acceptance_rate": 1.5}, "acceptance_rate"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "a \"model\" goes with methods draft_model and eagle3"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "a \"model\" goes with methods"),
    ("ngram", "must be a dict"),
    ({"method": "ngram", "num_speculative_tokens": 64}, "leaves no room in a step"),
])
def test_bad_speculative_config_fails_up_front(tiny_qwen3, spec, error):
    with pytest.raises(ValueError, match=error):
        LLM(tiny_qwen3[0], **ARGS, max_num_batched_tokens=64, speculative_config=spec)


def test_data_parallel_replicas_speculate(tiny_qwen3):
    """Each replica speculates; get_metrics() gives each replica's records labelled by its index."""
    path, _ = tiny_qwen3
    prompts = repetitive_prompts() * 2 + random_prompts([9, 30], seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(path, **ARGS, data_parallel_size=2, speculative_config=NGRAM)
    assert outputs(llm, prompts, params) == outputs(LLM(path, **ARGS), prompts, params)
    accepted = {m.labels["engine"]: m.value for m in llm.get_metrics()
                if m.name == "vllm:spec_decode_num_accepted_tokens"}
    assert accepted.keys() == {"0", "1"} and all(n > 0 for n in accepted.values())


def tf32_greedy(hf_model, prompt, tokens) -> bool:
    """Whether each token is transformers' float32 argmax after prompt and the tokens before it, up to
    twice the TF32 error the GPU test of verify graphs allows (relative norm 3e-3, test_verify_runs:
    |error| <= 3e-3 * ||logits||): random tiny models have near-ties (gaps ~3e-3 at logits ~9)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    gap = logits.amax(-1) - logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return bool((gap <= 2 * 3e-3 * logits.norm(dim=-1)).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_verify_steps_replay_cuda_graphs_and_keep_greedy_tokens(tiny_qwen3):
    """On the GPU the graphs of q_len 1 + k are captured (up to disable_by_batch_size sequences) and
    replayed by speculative steps, n-gram and replayed drafts alike; n-gram's tokens are greedy (up
    to TF32 near-ties) and mostly the plain engine's; the replayed drafts' acceptance is the chosen one."""
    path, hf_model = tiny_qwen3
    args = dict(device="cuda", dtype="float32", max_model_len=256, gpu_memory_utilization=0.3, kvcache_block_size=16)
    prompts = repetitive_prompts() + random_prompts([9, 30], seed=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = outputs(LLM(path, **args), prompts, params)
    for config in (NGRAM, REPLAY | {"disable_by_batch_size": 8}):
        gc.collect()  # the engine before frees its share of the GPU (each asks for 0.3 of it)
        torch.cuda.empty_cache()
        spec = LLM(path, **args, speculative_config=config)
        graph_runner, q_len = spec.engine.model_runner.graph_runner, 1 + config["num_speculative_tokens"]
        most = config.get("disable_by_batch_size", 32)
        assert max(b for b, q in graph_runner.graphs if q == q_len) == most
        replayed, replay = [], graph_runner.replay
        # on the instance, not through monkeypatch, whose undo list would keep the engine's GPU memory
        graph_runner.replay = lambda key, *a, replay=replay: replayed.append(key) or replay(key, *a)
        del graph_runner, replay  # spec's references are then the engine's last ones
        for _ in range(1 if config is NGRAM else 2):  # replay: the first run records
            ours = outputs(spec, prompts, params)
        if config is NGRAM:
            assert all(tf32_greedy(hf_model, p, o[0][0]) for p, o in zip(prompts, ours))
            assert sum(a == b for a, b in zip(ours, expected)) >= len(prompts) // 2
        else:  # forced acceptance: 0.7 per draft over 5 prompts x ~10 verify runs
            assert abs(spec.engine.spec_metrics.acceptance_rates()[0] - 0.7) < 0.25
        assert sum(q == q_len for _, q in replayed) > 10 and num_accepted(spec) > 0
        assert spec.engine.block_manager.num_free_blocks == spec.engine.model_runner.num_kvcache_blocks
        del spec
    gc.collect()  # the replay wrapper made a cycle: the next test's engine needs this one's memory back
    torch.cuda.empty_cache()
