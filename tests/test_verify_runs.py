"""Steps that sample several positions per sequence (verify runs: a sequence's last token and k draft
tokens in one step, 1 + k sampled positions), the seam of speculative decoding: the logits at those
positions against transformers', with both attention backends; the engine's tokens with drafts
proposed every step (right ones, wrong ones, stops and max_tokens inside runs, seeded sampling)
against transformers' greedy tokens and the engine's own plain runs; a CUDA graph of 3 tokens per
sequence against the eager step (GPU)."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.step_inputs import plan_step
from nanovllm.sequence import Sequence, SequenceStatus
from tests.conftest import VOCAB, hf_greedy, needs_interpreter, random_prompts


def sampled_logits(runner, plan, rows):
    """Execute plan on the ModelRunner, greedy; returns the logits its sampler saw [len(rows), vocab]."""
    seen, forward = [], runner.sampler.forward
    runner.sampler.forward = lambda logits, st: seen.append(logits.clone()) or forward(logits, st)
    try:
        runner.execute(plan, st=runner.sampler.prepare(rows, {}, None))
    finally:
        del runner.sampler.forward
    return seen[0]


def verify_step(llm, prompts, continuations, k):
    """By hand through the engine's BlockManager and ModelRunner: a step computing each prompt, then a
    uniform step of 1 + k tokens per sequence, its continuation's first token and the next k as
    drafts. Returns (that step's plan and rows' sequences, the logits of its sampled rows
    [len(prompts) * (k + 1), vocab])."""
    runner, bm = llm.engine.model_runner, llm.engine.block_manager

    def schedule(entries):
        for seq, n in entries:
            assert bm.allocate_slots(seq, n)
            seq.num_computed_tokens += n
        return entries

    seqs = [Sequence(p + c[:1], SamplingParams(temperature=0)) for p, c in zip(prompts, continuations)]
    plan = plan_step(schedule([(seq, len(p)) for seq, p in zip(seqs, prompts)]), runner.block_size, {})[0]
    assert len(plan.sample_rows) == 0  # the first continuation token is known: nothing sampled
    runner.execute(plan)
    drafts = {seq.seq_id: c[1:k + 1] for seq, c in zip(seqs, continuations)}
    plan, rows, _, runs = plan_step(schedule([(seq, 1 + k) for seq in seqs]), runner.block_size, {}, drafts=drafts)
    assert plan.uniform_q_len == k + 1 and not plan.is_decode and plan.num_sampled.tolist() == [k + 1] * len(seqs)
    assert rows == [seq for seq in seqs for _ in range(k + 1)] and [r[1] for r in runs] == list(range(0, len(rows), k + 1))
    logits = sampled_logits(runner, plan, rows)
    for seq in seqs:
        bm.free(seq)
    return (plan, rows), logits


def hf_logits(hf_model, prompt, continuation, k):
    """transformers' logits at the positions of the continuation's first k + 1 tokens (predicting the next)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + continuation[:k + 1]])).logits[0]
    return logits[len(prompt):].float()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_verify_step_logits_match_transformers(tiny_model, backend):
    """A sequence's greedy continuation from transformers as its drafts: the logits at its last 1 + k
    positions are transformers' there, and their argmax is its continuation."""
    path, hf_model = tiny_model
    llm = LLM(path, kvcache_block_size=16, device="cpu", attention_backend=backend)
    k, prompts = 3, random_prompts([9, 16, 30], seed=7)
    continuations = [hf_greedy(hf_model, p, k + 2) for p in prompts]
    _, logits = verify_step(llm, prompts, continuations, k)
    for i, (p, c) in enumerate(zip(prompts, continuations)):
        ours, theirs = logits[i * (k + 1):(i + 1) * (k + 1)].float(), hf_logits(hf_model, p, c, k)
        assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5  # float32 both
        assert ours.argmax(-1).tolist() == c[1:k + 2]


def generate_with_drafts(llm, prompts, params, proposals, wrong_every=0):
    """Run the engine on prompts, proposing drafts after every step to each decoding sequence: the next
    tokens of proposals[i] at its completion's length (every wrong_every-th proposal with its second
    draft made wrong). Returns (outputs in order, steps, drafts taken)."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    outputs, steps, taken, proposed = {}, 0, 0, 0
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
        steps += 1
        for rid, request in engine.requests.items():
            seq = request.seqs[0]
            if seq.status != SequenceStatus.RUNNING:
                continue
            drafts = proposals[int(rid)][seq.num_completion_tokens:seq.num_completion_tokens + 3]
            proposed += 1
            if wrong_every and proposed % wrong_every == 0 and len(drafts) > 1:
                drafts[1] = (drafts[1] + 1) % VOCAB
            taken += engine.add_draft_tokens(seq, drafts)
    assert engine.block_manager.num_free_blocks == engine.model_runner.num_kvcache_blocks
    assert engine.scheduler.drafts == {}
    return [outputs[str(i)] for i in range(len(prompts))], steps, taken


@pytest.mark.parametrize("wrong_every", [0, 2, 3])
def test_drafts_give_transformers_greedy_tokens(tiny_model, wrong_every, monkeypatch):
    """Right drafts are all taken (fewer steps); a wrong draft cuts its run there (the KV after it
    truncated, the step in flight behind it dropped) and the tokens stay transformers'. Prompts
    sharing a prefix then hit the prefix cache, whose blocks hash only accepted tokens."""
    path, hf_model = tiny_model
    llm = LLM(path, kvcache_block_size=16, device="cpu")
    truncations = []
    truncate = llm.engine.block_manager.truncate
    monkeypatch.setattr(llm.engine.block_manager, "truncate", lambda seq, n: truncations.append(n) or truncate(seq, n))
    prompts, max_tokens = random_prompts([5, 17, 30], seed=11), 24
    refs = [hf_greedy(hf_model, p, max_tokens) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs, steps, taken = generate_with_drafts(llm, prompts, params, refs, wrong_every)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert taken > 2 * len(prompts) and bool(truncations) == bool(wrong_every)
    if not wrong_every:
        assert steps < max_tokens // 2
    # each completion's first 16 tokens: its prompt's and completion's full blocks are cached
    again = [p + r[:16] for p, r in zip(prompts, refs)]
    outs = llm.generate(again, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r[16:20] for r in refs]
    assert [o.num_cached_tokens for o in outs] == [(len(a) - 1) // 16 * 16 for a in again]


def test_a_stop_or_max_tokens_inside_a_run_ends_the_output_exactly(tiny_qwen3):
    """A stop token inside a run ends the output at it; max_tokens is never overshot, whatever
    runs land near it (each length from 2 to 9)."""
    path, hf_model = tiny_qwen3
    llm = LLM(path, kvcache_block_size=16, device="cpu")
    prompts = random_prompts([6, 13], seed=21)
    refs = [hf_greedy(hf_model, p, 16) for p in prompts]
    j = 7  # the stop token: the continuation's 8th, at its first occurrence
    stop = refs[0][j]
    params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop], ignore_eos=True)
    outs, _, _ = generate_with_drafts(llm, prompts[:1], params, refs)
    first = refs[0].index(stop)
    assert outs[0].outputs[0].token_ids == refs[0][:first + 1]
    assert (outs[0].outputs[0].finish_reason, outs[0].outputs[0].stop_reason) == ("stop", stop)
    for max_tokens in range(2, 10):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs, _, _ = generate_with_drafts(llm, prompts, params, refs, wrong_every=3)
        assert [o.outputs[0].token_ids for o in outs] == [r[:max_tokens] for r in refs]


def test_seeded_sampling_and_logprobs_with_drafts_repeat_the_plain_run(tiny_qwen3):
    """A seeded row's noise is keyed by the completion index of the token it samples, so drafts
    that are the plain run's own tokens are all taken and give its tokens and logprobs."""
    path, _ = tiny_qwen3
    llm = LLM(path, kvcache_block_size=16, device="cpu")
    prompts = random_prompts([8, 21], seed=5)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=14, logprobs=2)
    plain = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in plain]
    assert len({tuple(t) for t in tokens}) == 2
    outs, steps, taken = generate_with_drafts(llm, prompts, params, tokens)
    assert [o.outputs[0].token_ids for o in outs] == tokens and taken > 2 * len(prompts)
    for ours, theirs in zip(outs, plain):
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_add_draft_tokens_takes_what_fits_and_refuses_bad_ids(tiny_qwen3):
    path, _ = tiny_qwen3
    llm = LLM(path, kvcache_block_size=16, device="cpu", max_num_batched_tokens=80, max_model_len=200)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": list(range(30))}, SamplingParams(temperature=0, max_tokens=8))
    engine.add_request("b", {"prompt_token_ids": list(range(40))}, SamplingParams(temperature=0, max_tokens=150))
    engine.add_request("c", {"prompt_token_ids": list(range(5))},
                       SamplingParams(temperature=0, max_tokens=8, presence_penalty=0.5))
    a, b, c = (engine.requests[r].seqs[0] for r in "abc")
    assert engine.add_draft_tokens(a, [1, 2]) == 0  # waiting: not decoding yet
    engine.step()
    assert all(s.num_computed_tokens == len(s) - 1 for s in (a, b, c))  # decoding, one token in flight
    with pytest.raises(ValueError, match="draft token ids must be integers"):
        engine.add_draft_tokens(a, [1, VOCAB])
    assert engine.add_draft_tokens(c, [1, 2]) == 0  # logits processors (penalties) see one row per sequence
    # a holds 1 of its 8 tokens: its run of 1 + 5 drafts samples the 2nd to the 7th, leaving the 8th to a plain step
    assert engine.add_draft_tokens(a, list(range(10))) == 5 and engine.scheduler.drafts[a.seq_id] == list(range(5))
    with pytest.raises(ValueError, match="already has draft tokens"):
        engine.add_draft_tokens(a, [1])
    assert engine.add_draft_tokens(b, list(range(100))) == 79  # a step holds 80 tokens: its last one and 79 drafts
    engine.abort_all_requests()
    assert engine.scheduler.drafts == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_of_three_tokens_per_sequence_matches_eager(tiny_qwen3, monkeypatch):
    """With graphs captured for q_len 3, a uniform step of 3 sequences x 3 tokens replays the (4, 3)
    graph (a padding sequence), whose logits are the eager step's (same kernels) and transformers'."""
    from nanovllm.engine import cuda_graphs
    monkeypatch.setattr(cuda_graphs, "CAPTURE_Q_LENS", (1, 3))
    path, hf_model = tiny_qwen3
    llm = LLM(path, kvcache_block_size=16, device="cuda", dtype="float32", max_model_len=256,
              gpu_memory_utilization=0.3)
    runner = llm.engine.model_runner
    assert {(4, 3), (4, 1)} <= set(runner.graph_runner.graphs)
    replayed = []
    replay = runner.graph_runner.replay
    monkeypatch.setattr(runner.graph_runner, "replay", lambda key, *a: replayed.append(key) or replay(key, *a))
    k, prompts = 2, random_prompts([9, 16, 30], seed=7)
    continuations = [hf_greedy(hf_model, p, k + 2) for p in prompts]
    step, graph_logits = verify_step(llm, prompts, continuations, k)
    assert replayed == [(4, 3)]
    graph_runner, runner.graph_runner = runner.graph_runner, None
    try:
        eager_logits = sampled_logits(runner, *step)  # the same step again: the same K/V written
    finally:
        runner.graph_runner = graph_runner
    assert replayed == [(4, 3)]
    torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-5, atol=1e-5)
    for i, (p, c) in enumerate(zip(prompts, continuations)):
        ours, theirs = graph_logits[i * (k + 1):(i + 1) * (k + 1)].float().cpu(), hf_logits(hf_model, p, c, k)
        assert ours.argmax(-1).tolist() == c[1:k + 2]
        # the Triton kernels' float32 dots run in TF32 (10-bit mantissa): ~1e-3 after the layers
        assert ((ours - theirs).norm() / theirs.norm()).item() < 3e-3
