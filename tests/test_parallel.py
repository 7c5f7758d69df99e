"""Tensor and data parallelism on CPU (gloo): TP=2 and DP=2 give the outputs of one engine, a
killed worker or replica fails generate with a clear error instead of a hang, and nothing is
left behind when the engine goes."""
import gc
import glob
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import nanovllm
from nanovllm import LLM, SamplingParams
from nanovllm.executor.data_parallel import DataParallelEngine
from tests.conftest import make_tiny_model, random_prompts

ARGS = dict(device="cpu", kvcache_block_size=16, max_model_len=128, max_num_batched_tokens=48)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def workload():
    shared = random_prompts([40], seed=7)[0]  # later prompts hit the prefix cache; 70 > 48 is chunked
    return random_prompts([5, 17, 70, 1, 33], seed=3) + [shared + p for p in random_prompts([3, 20], seed=4)]


def completions(llm, prompts, params=GREEDY):
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch,tp,load_format,backend", [
    ("qwen3", 2, "auto", "torch"), ("qwen3", 2, "dummy", "torch"), ("qwen2", 2, "auto", "torch"),
    ("qwen2", 2, "dummy", "torch"),
    ("qwen3", 4, "auto", "torch"),  # 2 KV heads over 4 ranks: each KV head replicated on 2 ranks
    ("qwen3", 2, "auto", "triton"),  # the Triton kernels in the interpreter on each rank's heads
])
def test_tensor_parallel_matches_one_rank(arch, tp, load_format, backend, tmp_path_factory):
    path, _ = make_tiny_model(arch, tmp_path_factory)
    prompts = workload()
    single = LLM(path, load_format=load_format, **ARGS)
    expected = completions(single, prompts)
    llm = LLM(path, load_format=load_format, tensor_parallel_size=tp, attention_backend=backend, **ARGS)
    assert completions(llm, prompts) == expected
    assert completions(llm, prompts[::-1]) == expected[::-1]  # second call: prefix hits everywhere
    sampled = [SamplingParams(temperature=0.8, top_k=20, max_tokens=6, seed=i) for i in range(len(prompts))]
    assert completions(llm, prompts, sampled) == completions(llm, prompts, sampled)  # seeded sampling repeats
    drawn = [SamplingParams(temperature=0.8, max_tokens=6, seed=i) for i in range(len(prompts))]
    assert completions(llm, prompts, drawn) == completions(single, prompts, drawn)  # drawn from vocabulary shards
    forked = llm.generate(prompts, SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in forked] == [[e[:6]] * 3 for e in expected]  # KV forked on every rank
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)  # logits of every prompt row, all ranks
    lps = [[x.logprob for d in o.prompt_logprobs[1:] for x in d.values()]
           for o in (m.generate([prompts[2]], scored, use_tqdm=False)[0] for m in (single, llm))]
    assert lps[0] == pytest.approx(lps[1], abs=1e-4)
    del single
    workers = llm.engine.model_runner.workers
    procs, tmpdir = workers.procs, workers.tmpdir
    del llm, workers
    gc.collect()
    assert all(p.exitcode == 0 for p in procs) and not os.path.exists(tmpdir)


def test_data_parallel_matches_one_replica(tiny_qwen3):
    prompts = workload() * 2
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True) for i in range(len(prompts))]
    expected = completions(LLM(tiny_qwen3[0], **ARGS), prompts, params)
    llm = LLM(tiny_qwen3[0], data_parallel_size=2, **ARGS)
    assert isinstance(llm, LLM) and isinstance(llm.engine, DataParallelEngine) and llm.llm_engine is llm.engine
    engine, sent = llm.engine, []
    send = engine._dispatch

    def dispatch():  # record which replica gets each request
        send()
        sent.extend(engine._owner.values())

    engine._dispatch = dispatch
    assert completions(llm, prompts, params) == expected
    assert {i for i, *_ in sent} == {0, 1}  # both replicas served the call
    outputs = llm.generate(prompts[:3], params[:3], use_tqdm=False)  # a second, smaller call
    assert [o.token_ids for o in outputs] == expected[:3]
    with pytest.raises(ValueError, match="request 1: the prompt is empty"):
        llm.generate([[1, 2], []], GREEDY)
    assert llm.reset_prefix_cache()
    # an id reused right after its abort gets the new request's outputs only, though its replica had
    # sent some of the aborted one's
    five = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("x", prompts[0], five)
    engine.step()
    time.sleep(1.0)
    engine.abort_request("x")
    engine.add_request("x", prompts[1], five)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.prompt_token_ids == prompts[1] for o in outputs} == {True}
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == expected[1]
    engine.add_request("defaults", prompts[2])  # no params: SamplingParams(), as a single engine takes it
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].request_id == "defaults" and outputs[-1].finished
    procs = llm.engine.procs
    del llm, dispatch
    engine = send = None  # the closure's names: released, as the engine must be for its replicas to exit
    gc.collect()
    assert all(p.exitcode == 0 for p in procs)


def test_router_balances_kv_reads():
    """Requests go to the replica with the least outstanding KV reads, largest first: a short prompt
    with a long output outweighs a long prompt with a short one (their prompt + max_tokens are equal)."""
    from nanovllm.config import Config
    from nanovllm.engine_args import EngineArgs
    from nanovllm.executor.replica_router import ReplicaRouter

    class Recording(ReplicaRouter):  # the transport is all that is left out
        abort_all_requests = reset_prefix_cache = None

        def _send(self, i, batch):
            sent[i] += [self._sent[sent_id] for sent_id, *_ in batch]  # the ids the replicas know them by, mapped back

    sent = {0: [], 1: []}
    router = Recording(Config.create(EngineArgs("Qwen/Qwen3-0.6B", load_format="dummy", device="cpu")), 2)
    for request_id, prompt_len, max_tokens in [("long prompt", 1000, 10), ("long output", 10, 1000), ("middle", 500, 500)]:
        router.add_request(request_id, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))
    router._dispatch()
    assert sent == {0: ["long output"], 1: ["middle", "long prompt"]}


def test_data_parallel_with_tensor_parallel(tiny_qwen3, tmp_path, monkeypatch):
    prompts = workload()
    expected = completions(LLM(tiny_qwen3[0], **ARGS), prompts)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the replicas' stores, apart from other runs' (spawned: they read it)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    llm = LLM(tiny_qwen3[0], data_parallel_size=2, tensor_parallel_size=2, **ARGS)
    assert completions(llm, prompts) == expected
    assert glob.glob(os.path.join(tmp_path, "nanovllm-tp-*"))  # where they are
    procs = llm.engine.procs
    del llm
    gc.collect()
    assert all(p.exitcode == 0 for p in procs)
    assert not glob.glob(os.path.join(tmp_path, "nanovllm-tp-*"))  # replicas cleaned up


def test_killed_worker_fails_generate_quickly(tiny_qwen3):
    llm = LLM(tiny_qwen3[0], tensor_parallel_size=2, **ARGS)
    worker = llm.engine.model_runner.workers.procs[0]
    original, steps = llm.engine.step, []

    def step():
        steps.append(1)
        if len(steps) == 3:
            os.kill(worker.pid, signal.SIGKILL)
        return original()

    llm.engine.step = step
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"worker rank 1 \(pid {worker.pid}\) exited with code -9"):
        llm.generate(workload(), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 30
    with pytest.raises(RuntimeError, match="create a new LLM"):  # refuses further work at once
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    tmpdir = llm.engine.model_runner.workers.tmpdir
    original = step = None  # noqa: F841 (breaks the reference to the engine)
    del llm
    gc.collect()
    assert not os.path.exists(tmpdir)
    assert completions(LLM(tiny_qwen3[0], tensor_parallel_size=2, **ARGS), [[1, 2, 3]])  # a new engine works


def test_killed_replica_fails_generate(tiny_qwen3):
    llm = LLM(tiny_qwen3[0], data_parallel_size=2, **ARGS)
    os.kill(llm.engine.procs[1].pid, signal.SIGKILL)
    llm.engine.procs[1].join()
    with pytest.raises(RuntimeError, match=r"replica 1 \(pid \d+\) exited with code -9; create a new LLM"):
        llm.generate(workload(), GREEDY, use_tqdm=False)


def test_interrupts_leave_parallel_engines_usable(tiny_qwen3, monkeypatch):
    prompts = workload()
    expected = completions(LLM(tiny_qwen3[0], **ARGS), prompts)
    tp = LLM(tiny_qwen3[0], tensor_parallel_size=2, **ARGS)
    calls = []

    def interrupting_read(*args, **kwargs):  # Ctrl-C while rank 0 waits for a step's tokens
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return read_tokens[0](*args, **kwargs)

    runner = tp.engine.model_runner
    read_tokens = [runner.read_tokens]
    runner.read_tokens = interrupting_read
    with pytest.raises(KeyboardInterrupt):
        tp.generate(prompts, GREEDY, use_tqdm=False)
    del runner.read_tokens, runner
    read_tokens.clear()  # nothing may keep the engine past `del tp` below
    assert completions(tp, prompts) == expected
    del tp
    gc.collect()

    dp = LLM(tiny_qwen3[0], data_parallel_size=2, **ARGS)
    receive = dp.engine._receive

    def interrupting_receive(i, *args):
        message = receive(i, *args)
        if message[0] == "outputs":
            raise KeyboardInterrupt
        return message

    monkeypatch.setattr(dp.engine, "_receive", interrupting_receive)
    with pytest.raises(KeyboardInterrupt):
        dp.generate(prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    monkeypatch.setattr(dp.engine, "_receive", receive)
    assert completions(dp, prompts) == expected


def test_tensor_parallel_size_must_split_the_model(tiny_qwen3):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not split this model"):
        LLM(tiny_qwen3[0], tensor_parallel_size=3, **ARGS)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(tiny_qwen3[0], tensor_parallel_size=0, **ARGS)


def test_failed_start_leaves_nothing_behind(tiny_qwen3, tmp_path):
    """Every rank refuses a checkpoint that lacks a tensor; the error reaches the caller and the
    worker process and the rendezvous directory are gone."""
    from tests.test_reliability import copy_model, edit_tensors
    path = copy_model(tiny_qwen3[0], tmp_path / "m")
    edit_tensors(path, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    stores_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "nanovllm-tp-*")))
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*qkv_proj.weight \(shard k\)"):
        LLM(str(path), tensor_parallel_size=2, **ARGS)
    gc.collect()
    assert time.monotonic() - start < 60
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "nanovllm-tp-*"))) == stores_before
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("nanovllm-")]
    assert completions(LLM(tiny_qwen3[0], tensor_parallel_size=2, **ARGS), [[1, 2, 3]])  # the next engine starts


@pytest.mark.parametrize("parallel,dead", [("tensor_parallel_size", "worker rank 1 exited with code 1 while starting"),
                                           ("data_parallel_size", "replica 0 (pid ")])
def test_script_without_main_guard_fails_fast(tiny_qwen3, tmp_path, parallel, dead):
    """A script that creates a parallel engine at module level: each spawned worker or replica
    re-imports it and dies in multiprocessing's bootstrap; the start says so at once and names
    the guard (TP waited in the rendezvous for its 10-minute timeout before)."""
    script = tmp_path / "no_guard.py"
    script.write_text(f"from nanovllm import LLM\nLLM({tiny_qwen3[0]!r}, {parallel}=2, **{ARGS!r})\n")
    start = time.monotonic()
    root = os.path.dirname(os.path.dirname(os.path.abspath(nanovllm.__file__)))  # this checkout's nanovllm
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": root})
    assert run.returncode != 0
    assert dead in run.stderr and "while starting" in run.stderr, run.stderr[-2000:]
    assert 'if __name__ == "__main__":' in run.stderr
    assert time.monotonic() - start < 120


@pytest.mark.parametrize("lock", [False, True])
def test_worker_progress_bars_leak_no_semaphore(tmp_path, lock):
    """A tensor-parallel worker leaves by os._exit; one that drew a tqdm bar (loading a GGUF does)
    would leak tqdm's multiprocessing lock, and Python warned of a leaked semaphore when the
    user's script ended. Without process_local_progress_lock the warning is expected (else this
    tqdm leaks nothing and there is nothing to check)."""
    script = tmp_path / "bar.py"
    script.write_text(
        "import multiprocessing as mp, os\n"
        "def child():\n"
        f"    if {lock}:\n"
        "        from nanovllm.executor.tp_workers import process_local_progress_lock\n"
        "        process_local_progress_lock()\n"
        "    from tqdm import tqdm\n"
        "    for _ in tqdm(range(2), disable=False): pass\n"
        "    os._exit(0)\n"
        "if __name__ == '__main__':\n"
        "    p = mp.get_context('spawn').Process(target=child); p.start(); p.join()\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(nanovllm.__file__)))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": root})
    assert run.returncode == 0, run.stderr[-2000:]
    leaked = "leaked semaphore" in run.stderr
    if not lock and not leaked:
        pytest.skip("this tqdm leaks no semaphore on os._exit")
    assert leaked != lock, run.stderr[-2000:]
