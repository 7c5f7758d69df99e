"""Data-parallel replicas as Ray actors, on a Ray cluster of two simulated nodes (CPU, gloo): the
outputs of one engine, in order, on distinct nodes; a killed replica fails generate with a
clear error; nothing of ours is left after the LLM goes."""
import gc
import os
import time

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # simulated nodes all on 127.0.0.1
ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from tests.test_parallel import ARGS, completions, workload  # noqa: E402

RAY = dict(distributed_executor_backend="ray", **ARGS)


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def dead(actor) -> bool:
    try:
        ray.get(actor.info.remote(), timeout=30)
        return False
    except ray.exceptions.RayActorError:
        return True


@pytest.mark.parametrize("tp", [1, 2])
def test_replicas_on_two_nodes_give_the_outputs_of_one_engine(cluster, tiny_qwen3, tp):
    prompts = workload() * 2
    expected = completions(LLM(tiny_qwen3[0], **ARGS), prompts)
    start = time.monotonic()
    llm = LLM(tiny_qwen3[0], data_parallel_size=2, tensor_parallel_size=tp, **RAY)
    print(f"\n2 Ray replicas (TP={tp}) started in {time.monotonic() - start:.1f} s")
    nodes = {node.node_id for node in cluster.list_all_nodes()}
    assert set(llm.engine.nodes) == nodes  # one replica per node (bundles spread)
    assert completions(llm, prompts) == expected
    assert completions(llm, prompts[:3]) == expected[:3]  # a second, smaller call
    assert llm.reset_prefix_cache()
    actors, group = llm.engine._actors, llm.engine._placement_group
    assert len(replica_processes()) >= 2  # (the check below sees them while they live)
    del llm
    gc.collect()
    assert all(dead(a) for a in actors)
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"
    deadline = time.monotonic() + 30
    while replica_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not replica_processes()  # the actors' processes (and their tensor-parallel children) are gone


def test_replicas_speculate_and_report_their_metrics(cluster, tiny_qwen3):
    from tests.test_spec_decode import NGRAM, repetitive_prompts
    prompts = repetitive_prompts() * 2
    expected = completions(LLM(tiny_qwen3[0], **ARGS), prompts)
    llm = LLM(tiny_qwen3[0], data_parallel_size=2, speculative_config=NGRAM, **RAY)
    assert completions(llm, prompts) == expected
    accepted = {m.labels["engine"]: m.value for m in llm.get_metrics()
                if m.name == "vllm:spec_decode_num_accepted_tokens"}
    assert accepted.keys() == {"0", "1"} and all(n > 0 for n in accepted.values())
    del llm  # its actors go now, not in a later test
    gc.collect()


def replica_processes() -> list[int]:
    """Live processes whose title Ray set to one of our actors' (ray::Replica...)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::Replica"):
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_killed_replica_fails_generate_quickly(cluster, tiny_qwen3):
    llm = LLM(tiny_qwen3[0], data_parallel_size=2, **RAY)
    original, steps = llm.engine.step, []

    def step():
        steps.append(1)
        if len(steps) == 3:
            ray.kill(llm.engine._actors[1])
        return original()

    llm.engine.step = step
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)replica 1 \(Ray node [0-9a-f]+\) died: .*killed by `ray.kill`.*create a new LLM"):
        llm.generate(workload() * 4, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 60
    llm = step = original = None  # (the closure holds them too)
    gc.collect()  # its placement group goes: the cluster's CPUs are free for the next test


def test_interrupted_call_leaves_the_replicas_usable(cluster, tiny_qwen3):
    prompts = workload()
    expected = completions(LLM(tiny_qwen3[0], **ARGS), prompts)
    llm = LLM(tiny_qwen3[0], data_parallel_size=2, **RAY)
    original, steps = llm.engine.step, []

    def step():
        steps.append(1)
        if len(steps) == 2:  # the requests are on the replicas, and running
            raise KeyboardInterrupt
        return original()

    llm.engine.step = step
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    llm.engine.step = original
    assert completions(llm, prompts) == expected
    llm = step = original = None  # (the closure holds them too)
    gc.collect()


def test_ray_backend_without_ray_says_how_to_install(monkeypatch, tiny_qwen3):
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r'pip install "nanovllm\[ray\]"'):
        LLM(tiny_qwen3[0], **RAY)
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        LLM(tiny_qwen3[0], **{**RAY, "distributed_executor_backend": "slurm"})


def test_a_script_that_dies_releases_its_replicas(cluster, tiny_qwen3, tmp_path):
    """An exception (or Ctrl-C) that ends the script: Ray ends the job's actors with it, so their
    resources come back and the placement group goes."""
    import subprocess
    import sys
    script = tmp_path / "dies.py"
    script.write_text(f"""
import ray
from nanovllm import LLM
ray.init(address={cluster.address!r})
llm = LLM({tiny_qwen3[0]!r}, data_parallel_size=2, **{RAY!r})
print(llm.engine._placement_group.id.hex(), flush=True)
raise SystemExit("dying with live replicas")
""")
    total = ray.cluster_resources()["CPU"]
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert "dying with live replicas" in run.stderr, run.stderr[-2000:]
    group = run.stdout.split()[-1]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (ray.available_resources().get("CPU", 0) < total
                                           or ray.util.placement_group_table()[group]["state"] != "REMOVED"):
        time.sleep(0.5)
    assert ray.available_resources()["CPU"] == total
    assert ray.util.placement_group_table()[group]["state"] == "REMOVED"
