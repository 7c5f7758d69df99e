"""Reliability: random workloads (with and without n-gram speculation) keep the block manager and
scheduler consistent after every step, an interrupted generate leaves the engine clean, broken
model files give errors that name them."""
import gc
import json
import os
import weakref
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm import LLM, SamplingParams
from nanovllm.sequence import Sequence
from tests.conftest import VOCAB, hf_greedy, random_prompts
from tests.test_block_manager import check_invariants as check_block_invariants


def check_invariants(llm, scheduled):
    bm, sched = llm.engine.block_manager, llm.engine.scheduler
    assert sum(n for _, n in scheduled) <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    check_block_invariants(bm, sched.running + list(sched.waiting))
    for seq in sched.running:
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
        # every full block in the prefix cache holds exactly this sequence's tokens
        for i in range(seq.num_hashed_blocks):
            assert bm.blocks[seq.block_table[i]].token_ids == seq.token_ids[i * bm.block_size:(i + 1) * bm.block_size]
    for seq in sched.waiting:
        assert seq.block_table == []


request = st.tuples(st.integers(1, 60), st.integers(1, 12), st.integers(0, 3), st.sampled_from([0.0, 0.8]))
workload = st.lists(st.lists(request, min_size=1, max_size=6), min_size=1, max_size=4)  # arrival waves


@pytest.fixture(scope="module")
def engines(tiny_qwen3):
    path = tiny_qwen3[0]
    engines = [LLM(path, device="cpu", kvcache_block_size=8, num_kvcache_blocks=12, max_model_len=96, max_num_seqs=4,
                max_num_batched_tokens=16),
            LLM(path, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=96, max_num_seqs=8,
                max_num_batched_tokens=64),
            LLM(path, device="cpu", kvcache_block_size=4, num_kvcache_blocks=30, max_model_len=96, max_num_seqs=3,
                max_num_batched_tokens=9, enable_prefix_caching=False),
            LLM(path, device="cpu", kvcache_block_size=8, num_kvcache_blocks=16, max_model_len=96, max_num_seqs=4,
                max_num_batched_tokens=48, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                               "prompt_lookup_min": 1, "prompt_lookup_max": 2})]
    speculator = engines[3].engine.speculator  # as many verify runs as the random prompts allow:
    speculator.uniform, speculator.max_idle_skip = True, 0  # every decoding row with drafts, no backoff
    return engines


STATS = Counter()


@pytest.fixture(scope="module", autouse=True)
def report_property_stats():
    """After the module: how much the property test exercised; its workloads must have preempted."""
    yield
    print(f"\nproperty tests: {STATS['workloads']} random workloads, {STATS['steps']} engine steps checked, "
          f"{STATS['preemptions']} preemptions, {STATS['verify_runs']} verify runs")
    assert STATS["workloads"] == 0 or STATS["preemptions"] > 0
    assert STATS["workloads"] == 0 or STATS["verify_runs"] > 0


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(waves=workload, which=st.integers(0, 3), seed=st.integers(0, 10**6))
def test_random_workloads_keep_invariants(engines, waves, which, seed):
    llm = engines[which]
    engine = llm.engine
    shared = random_prompts([40], seed=seed)[0]
    recorded = []
    original = llm.engine.scheduler.schedule

    def schedule():
        recorded.append(original())
        return recorded[-1]

    llm.engine.scheduler.schedule = schedule
    try:
        all_seqs, reported = [], []

        def step():
            reported.extend(out.request_id for out in engine.step() if out.finished)
            check_invariants(llm, recorded[-1])
            STATS["steps"] += 1

        for wave in waves:  # each wave arrives after a few steps of the previous ones
            prompts = [shared[:prefix * 10] + random_prompts([n], seed=seed + i)[0]
                       for i, (n, _, prefix, _) in enumerate(wave)]
            params = [SamplingParams(temperature=t, max_tokens=m, ignore_eos=True, seed=i)
                      for i, (_, m, _, t) in enumerate(wave)]
            for p, sp in zip(prompts, params):
                engine.add_request(f"{seed}-{len(all_seqs)}", p, sp)
                all_seqs.append((engine.scheduler.waiting[-1], len(p)))
            for _ in range(3):
                if engine.has_unfinished_requests():
                    step()
        while engine.has_unfinished_requests():
            step()
    finally:
        llm.engine.scheduler.schedule = original
    STATS["workloads"] += 1
    STATS["preemptions"] = sum(e.engine.scheduler.num_preemptions for e in engines)
    STATS["verify_runs"] = engines[3].engine.spec_metrics.num_drafts  # the one with speculative decoding
    for seq, prompt_len in all_seqs:
        expected = min(seq.sampling_params.max_tokens, max(1, 96 - prompt_len))
        assert seq.is_finished and seq.finish_reason == "length" and seq.num_completion_tokens == expected
        assert all(t >= 0 for t in seq.token_ids)  # no PLACEHOLDER left behind
    assert sorted(reported) == sorted(s.request_id for s, _ in all_seqs)  # each finish reported once
    assert llm.engine.block_manager.num_free_blocks == llm.engine.model_runner.num_kvcache_blocks


class Boom(Exception):
    pass


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_interrupted_generate_leaves_engine_clean(tiny_qwen3, error):
    path, hf_model = tiny_qwen3
    llm = LLM(path, device="cpu", kvcache_block_size=8, max_model_len=128)
    sampler, calls = llm.engine.model_runner.sampler, [0]
    original = sampler.forward

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 5:
            raise error("injected")
        return original(*args, **kwargs)

    sampler.forward = failing
    prompts = random_prompts([20, 33, 7], seed=21)
    with pytest.raises(error):
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    sampler.forward = original
    assert llm.engine.block_manager.num_free_blocks == llm.engine.model_runner.num_kvcache_blocks
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(hf_model, p, 10) for p in prompts]


def test_interrupt_from_the_tokenizer_leaves_engine_clean(tiny_qwen3):
    llm = LLM(tiny_qwen3[0], device="cpu", kvcache_block_size=8, max_model_len=128)

    class BrokenTokenizer:
        eos_token_id = None

        def decode(self, *args, **kwargs):
            raise KeyboardInterrupt

    llm.engine.processor.tokenizer = BrokenTokenizer()
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts([5, 9], seed=3), SamplingParams(max_tokens=4), use_tqdm=False)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.model_runner.num_kvcache_blocks
    assert not llm.engine.has_unfinished_requests()


# ---- broken model files -------------------------------------------------------------------

def copy_model(src, dst):
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    return dst


def test_missing_shard_named_in_index(tiny_qwen3, tmp_path):
    path = copy_model(tiny_qwen3[0], tmp_path / "m")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    os.rename(path / "model.safetensors", path / "model-00001-of-00002.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="names shard 'model-00002-of-00002.safetensors'"):
        LLM(str(path), device="cpu")


def test_truncated_safetensors(tiny_qwen3, tmp_path):
    path = copy_model(tiny_qwen3[0], tmp_path / "m")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"cannot read weights file .*model\.safetensors"):
        LLM(str(path), device="cpu")


def edit_tensors(path, edit):
    from safetensors.torch import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_tensor_of_wrong_shape(tiny_qwen3, tmp_path):
    path = copy_model(tiny_qwen3[0], tmp_path / "m")
    edit_tensors(path, lambda t: t.update({"model.layers.1.mlp.down_proj.weight": torch.zeros(64, 95)}))
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.down_proj.weight'.*shape \(64, 95\), expected \(64, 96\)"):
        LLM(str(path), device="cpu")


def test_missing_tensor(tiny_qwen3, tmp_path):
    path = copy_model(tiny_qwen3[0], tmp_path / "m")
    edit_tensors(path, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model.layers.0.self_attn.qkv_proj.weight \(shard k\)"):
        LLM(str(path), device="cpu")


def test_truncated_gguf(tmp_path):
    """The demo GGUF assembled from five of its six parts."""
    from nanovllm.loader.demo import demo_model_path
    full = demo_model_path()
    truncated = tmp_path / "five-of-six.gguf"
    with open(full, "rb") as f, open(truncated, "wb") as g:
        g.write(f.read(5 * 89_128_960))
    with pytest.raises(ValueError, match=f"cannot read GGUF file {truncated}"):
        LLM(str(truncated), device="cpu")


def test_kv_cache_too_small_says_what_to_change(tiny_qwen3):
    with pytest.raises(ValueError, match=r"needs 8 .*raise cpu_kvcache_space_gib or lower max_model_len"):
        LLM(tiny_qwen3[0], device="cpu", kvcache_block_size=16, max_model_len=128, cpu_kvcache_space_gib=1e-5)


def test_warmup_step_runs_before_the_kv_cache_exists(tiny_qwen3, monkeypatch):
    """On the GPU the KV pool is sized by a warm-up step run while the runner is being built; make
    the CPU build run it too, so CI catches what that step needs before construction ends."""
    from nanovllm.engine import model_runner

    sizes = []

    def num_kv_blocks(config, spec, max_blocks_per_seq, profile, *args):
        sizes.append((profile(), spec.block_bytes))
        return real(config, spec, max_blocks_per_seq, profile, *args)

    real = model_runner.num_kv_blocks
    monkeypatch.setattr(model_runner, "num_kv_blocks", num_kv_blocks)
    llm = LLM(tiny_qwen3[0], device="cpu", kvcache_block_size=16, max_model_len=64, max_num_batched_tokens=96,
              max_num_seqs=4)
    [(warmup_bytes, block_bytes)] = sizes
    assert warmup_bytes == 6 * block_bytes  # 96 tokens in blocks of 16
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))[0].outputs[0].token_ids


# ---- soak and exit --------------------------------------------------------------------------

def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def live_objects() -> tuple[int, int, int]:
    """(objects the garbage collector tracks, live Sequences, live tensors), after a collection."""
    gc.collect()
    objects = gc.get_objects()
    return (len(objects), sum(type(o) is Sequence for o in objects),
            sum(issubclass(type(o), torch.Tensor) for o in objects))


def test_soak_10000_requests(tiny_qwen3):
    """10,000 requests in 40 calls leave nothing behind: every KV block free, empty scheduler
    queues, no Sequence alive, and no more objects, tensors or resident memory after the last call
    than after the first (signals that a loaded machine does not move; the time per request, which
    it does, is printed)."""
    import time
    llm = LLM(tiny_qwen3[0], device="cpu", kvcache_block_size=16, num_kvcache_blocks=160, max_model_len=128,
              max_num_seqs=128, max_num_batched_tokens=512)
    engine = llm.engine
    free_at_start = engine.block_manager.num_free_blocks
    g = torch.Generator().manual_seed(0)
    served, per_call = 0, []
    for call in range(40):
        n = 250
        lengths = torch.randint(1, 60, (n,), generator=g).tolist()
        prompts = [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lengths]
        max_tokens = torch.randint(1, 12, (n,), generator=g).tolist()
        params = [SamplingParams(temperature=[0.0, 0.7, 1.0][i % 3], top_k=[-1, 5][i % 2], top_p=[1.0, 0.9][i % 2],
                                 max_tokens=m, ignore_eos=True, seed=i if i % 4 == 0 else None)
                  for i, m in enumerate(max_tokens)]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = (time.perf_counter() - t) / n
        assert [len(o.token_ids) for o in outs] == max_tokens
        assert all(o.finish_reason == "length" for o in outs)
        assert engine.block_manager.num_free_blocks == free_at_start
        assert not engine.scheduler.waiting and not engine.scheduler.running and not engine.requests
        del outs
        per_call.append((seconds, rss_mib(), *live_objects()))
        served += n
    (t0, m0, objects0, seqs0, tensors0), (t1, m1, objects1, seqs1, tensors1) = per_call[0], per_call[-1]
    print(f"soak: {served} requests in {len(per_call)} calls; time/request {t0 * 1e3:.2f} ms -> {t1 * 1e3:.2f} ms "
          f"(median {sorted(c[0] for c in per_call)[len(per_call) // 2] * 1e3:.2f} ms); RSS {m0:.0f} MiB -> {m1:.0f} MiB; "
          f"objects {objects0} -> {objects1}, tensors {tensors0} -> {tensors1}")
    assert served >= 10_000
    assert seqs0 == seqs1 == 0 and tensors1 <= tensors0
    # no growth with the requests served: one object kept per request would add 9,750
    assert objects1 < objects0 + 1000 and m1 < m0 + 200


def test_deleting_the_llm_releases_the_kv_cache(tiny_qwen3):
    llm = LLM(tiny_qwen3[0], device="cpu", kvcache_block_size=16, max_model_len=128)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
    cache = weakref.ref(llm.engine.model_runner.kv_cache)
    model = weakref.ref(llm.engine.model_runner.model)
    del llm
    gc.collect()
    assert cache() is None and model() is None
