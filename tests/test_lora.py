"""LoRA adapters served by the engine (enable_lora=True): greedy tokens equal transformers + peft's
for each of three adapters of different ranks and target sets, alone and mixed in one batch
with base rows; the prefix cache keeps adapters apart; adapters evicted from their slot and from
the host cache come back the same; tensor parallelism; bad adapters are refused before any work,
and the engine keeps serving; vLLM's adapter calls (llm.llm_engine.add_lora, remove_lora,
list_loras, pin_lora), on one engine, every tensor-parallel rank and every data-parallel replica."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm import LLM, LoRARequest, SamplingParams
from nanovllm.engine import lora_manager
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.sequence import Sequence
from tests.conftest import hf_greedy, make_tiny_model, needs_interpreter, random_prompts
from tests.peft_adapters import ADAPTERS, make_adapter, peft_greedy, tiny_adapters

pytest.importorskip("peft")
ARGS = dict(device="cpu", kvcache_block_size=16, max_model_len=128, max_num_batched_tokens=48, enable_lora=True,
            max_loras=3, max_lora_rank=16)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
NAMES = list(ADAPTERS)


def workload():
    shared = random_prompts([40], seed=7)[0]  # two full blocks: later prompts hit the prefix cache; 70 > 48 is chunked
    return random_prompts([5, 17, 70, 1, 33], seed=3) + [shared + p for p in random_prompts([3, 20], seed=4)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(base directory, {name: LoRARequest}, {name or None: reference completions of workload()},
    {name or None: the transformers (+ peft) model})."""
    path, model, adapters = tiny_adapters(tmp_path_factory)
    models = {name: adapters[name][1] for name in NAMES} | {None: model}
    requests = {name: LoRARequest(name, i + 1, adapters[name][0]) for i, name in enumerate(NAMES)}
    expected = {name: peft_greedy(m, workload(), GREEDY.max_tokens) for name, m in models.items()}
    for name in NAMES:  # each adapter changes the tokens, so agreement below is not the base model's
        assert expected[name] != expected[None]
    return path, requests, expected, models


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny[0], **ARGS)


def completions(llm, prompts, lora, params=GREEDY):
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False, lora_request=lora)]


def mixed(requests, expected, shift=0):
    """workload() cycling through the three adapters and the base model from the shift-th: (lora_request
    per prompt, expected completions)."""
    names = [(NAMES + [None])[(i + shift) % 4] for i in range(len(workload()))]
    return [requests[m] if m else None for m in names], [expected[m][i] for i, m in enumerate(names)]


@pytest.mark.parametrize("name", NAMES)
def test_each_adapter_matches_peft(llm, tiny, name):
    _, requests, expected, _ = tiny
    out = llm.generate(workload(), GREEDY, use_tqdm=False, lora_request=requests[name])
    assert [o.token_ids for o in out] == expected[name]
    assert all(o.lora_request is requests[name] for o in out)
    assert completions(llm, workload(), None) == expected[None]  # the same engine, base rows


def test_mixed_batch_equals_each_alone(llm, tiny):
    _, requests, expected, _ = tiny
    for shift in (0, 1):  # each prompt under two of the four, beside the others
        loras, want = mixed(requests, expected, shift)
        assert completions(llm, workload(), loras) == want


@needs_interpreter
def test_triton_kernels_through_the_engine(tiny):
    """attention_backend="triton" on CPU: the LoRA kernels too, in Triton's interpreter (eager steps:
    tiles of 16 rows for decode steps, of 64 for prefill steps of more rows)."""
    path, requests, expected, models = tiny
    llm = LLM(path, attention_backend="triton", **{**ARGS, "max_num_batched_tokens": 256})
    manager, block_ms = llm.engine.model_runner.lora, set()
    plan = manager.plan

    def recording_plan(scheduled, graph_shape):
        step = plan(scheduled, graph_shape)
        if step is not None:
            block_ms.add(step.block_m)
        return step
    manager.plan = recording_plan
    prompts = workload()[:4]
    loras = [requests["all"], None, requests["qv"], requests["attn"]]
    assert completions(llm, prompts, loras) == [expected[m][i] for i, m in enumerate(["all", None, "qv", "attn"])]
    many = random_prompts([40, 45, 50], seed=9)  # prefill steps of 135 rows: tiles of 64
    assert completions(llm, many, requests["attn"]) == peft_greedy(models["attn"], many, GREEDY.max_tokens)
    assert block_ms == {16, 64}
    assert llm.engine.model_runner.lora.context.use_triton


def test_prefix_cache_is_keyed_by_adapter(llm, tiny):
    _, requests, expected, _ = tiny
    prompt, i = workload()[5], 5  # 43 tokens: two full blocks
    assert llm.reset_prefix_cache()
    runs = [requests["qv"], requests["attn"], requests["qv"], None, None, requests["attn"]]
    cached = []
    for lora in runs:
        out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
        assert out.token_ids == expected[lora.lora_name if lora else None][i]
        cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 32, 0, 32, 32]


def test_evicted_adapters_come_back_the_same(tiny):
    """One slot and one adapter on the host: every change of adapter evicts the last one from both,
    and reads the next from disk; a mixed batch runs one adapter at a time."""
    path, requests, expected, _ = tiny
    llm = LLM(path, **{**ARGS, "max_loras": 1, "max_cpu_loras": 1})
    manager, loads = llm.engine.model_runner.lora, []
    plan = manager.plan

    def recording_plan(scheduled, graph_shape):
        step = plan(scheduled, graph_shape)
        assert len({seq.lora_int_id for seq, _ in scheduled} - {0}) <= 1
        if step is not None:
            loads.extend(request.lora_name for _, request in step.loads)
        return step
    manager.plan = recording_plan
    prompts = workload()
    for name in ["qv", "attn", "qv", "all"]:
        assert completions(llm, prompts[:3], requests[name]) == expected[name][:3]
    loras, want = mixed(requests, expected)
    assert completions(llm, prompts, loras) == want
    assert loads[:4] == ["qv", "attn", "qv", "all"] and len(loads) >= 6
    assert len(manager.host) == 1 and len(manager.slots) == 1


def test_a_failed_step_leaves_no_stale_slot(tiny):
    """A step that fails after its adapters got slots, before they were copied in: the next call
    loads them anew rather than running the slots' old contents."""
    path, requests, expected, _ = tiny
    llm = LLM(path, **ARGS)
    manager = llm.engine.model_runner.lora
    begin_step = manager.begin_step

    def failing(step, tensors):
        manager.begin_step = begin_step
        raise RuntimeError("injected")
    manager.begin_step = failing
    with pytest.raises(RuntimeError, match="injected"):
        completions(llm, workload()[:2], requests["all"])
    assert completions(llm, workload()[:2], requests["all"]) == expected["all"][:2]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_other_architectures(arch, tmp_path_factory):
    """Qwen2 (a bias on q/k/v, added by the base product) and Llama (llama3 rope scaling)."""
    path, model = make_tiny_model(arch, tmp_path_factory)
    adapter = tmp_path_factory.mktemp(f"{arch}_adapter")
    reference = make_adapter(model, adapter, 5, **ADAPTERS["all"])
    llm = LLM(path, **ARGS)
    prompts = workload()[:4]
    loras = [LoRARequest("all", 1, str(adapter)), None] * 2
    want = [hf_greedy(reference if lora else model, p, GREEDY.max_tokens) for p, lora in zip(prompts, loras)]
    assert completions(llm, prompts, loras) == want


def router_adapter(model, source, path):
    """The adapter at source with a module LoRA on layer 0's router (mlp.gate) added, as PEFT wrote
    one before transformers 5 made the router a module of its own (PEFT now saves target_parameters)."""
    shutil.copytree(source, path)
    config = json.loads((path / "adapter_config.json").read_text())
    config["target_modules"] = sorted(set(config["target_modules"]) | {"gate"})
    (path / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(path / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0.mlp.gate"
    tensors[f"{prefix}.lora_A.weight"] = torch.randn(config["r"], model.config.hidden_size)
    tensors[f"{prefix}.lora_B.weight"] = torch.randn(model.config.num_experts, config["r"])
    save_file(tensors, path / "adapter_model.safetensors")


def test_mixture_of_experts(tmp_path_factory):
    """A tiny Qwen3-MoE: an adapter of its attention equals transformers + peft's tokens (its
    experts run as without adapters); one of its router (mlp.gate), which keeps its own method and
    no LoRA layer, and one of its experts are refused by name before any work, and the engine keeps
    serving."""
    path, model = make_tiny_model("qwen3_moe", tmp_path_factory)
    root = tmp_path_factory.mktemp("moe_adapters")
    reference = make_adapter(model, root / "attn", 6, **ADAPTERS["attn"])
    router_adapter(model, root / "attn", root / "router")
    # PEFT saves experts' projections as target_parameters (the fused experts' gate_up_proj)
    make_adapter(model, root / "experts", 8, r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj", "up_proj"])
    llm = LLM(path, **ARGS)
    prompts = workload()[:4]
    loras = [LoRARequest("attn", 1, str(root / "attn")), None] * 2
    want = [hf_greedy(reference if lora else model, p, GREEDY.max_tokens) for p, lora in zip(prompts, loras)]
    assert completions(llm, prompts, loras) == want
    with pytest.raises(ValueError, match=r"LoRA adapter 'router' .*target module\(s\) \['gate'\] not supported \(a "
                       r"mixture of experts' router, mlp\.gate, and its experts take no adapter\)"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("router", 2, str(root / "router")))
    with pytest.raises(ValueError, match=r"LoRA adapter 'experts' .*target_parameters \['gate_up_proj'\] .* is not "
                       r"supported \(a mixture of experts' router, mlp\.gate, and its experts take no adapter\)"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("experts", 3, str(root / "experts")))
    assert completions(llm, prompts, loras) == want


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel(tiny, tp):
    """TP=2 and 4 (gloo; with 4 ranks each KV head, and its B rows, on two): A or B split as each
    base weight, the row-parallel layers' deltas summed with their partial sums."""
    path, requests, expected, _ = tiny
    loras, want = mixed(requests, expected)
    assert completions(LLM(path, tensor_parallel_size=tp, **ARGS), workload(), loras) == want


def test_data_parallel(tiny):
    """Two replicas: requests and their adapters go to either; the adapter calls go to both, also
    while they run requests (whose outputs sent meanwhile are kept)."""
    path, requests, expected, _ = tiny
    loras, want = mixed(requests, expected, 1)
    llm = LLM(path, data_parallel_size=2, **ARGS)
    assert completions(llm, workload() * 2, loras * 2) == want * 2
    engine = llm.llm_engine
    assert engine.list_loras() == {1, 2, 3} and engine.remove_lora(1) and engine.list_loras() == {2, 3}
    with pytest.raises(ValueError, match=r"lora_int_id 1 is not loaded on data-parallel replica\(s\) \[0, 1\]"):
        engine.pin_lora(1)
    for i, prompt in enumerate(workload()[:2]):  # one to each replica
        engine.add_request(str(i), prompt, GREEDY, lora_request=requests["qv"])
    engine.step()
    assert engine.add_lora(requests["qv"]) and engine.pin_lora(1) and engine.list_loras() == {1, 2, 3}
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out.outputs[0].token_ids) for out in engine.step())
    assert [outputs[str(i)] for i in range(2)] == expected["qv"][:2]


def test_scheduler_admits_at_most_max_loras_adapters():
    """Waiting sequences of a third adapter wait, those behind them of running adapters go first."""
    scheduler = Scheduler(8, 100, BlockManager(64, 16), max_loras=2)
    lora = {i: LoRARequest(f"a{i}", i, "/x") for i in (1, 2, 3)}
    seqs = [Sequence([1, 2, 3], SamplingParams(), lora_request=lora[i] if i else None) for i in (1, 2, 3, 0, 1, 3)]
    for seq in seqs:
        scheduler.add(seq)
    assert [seq for seq, _ in scheduler.schedule()] == [seqs[i] for i in (0, 1, 3, 4)]
    assert list(scheduler.waiting) == [seqs[2], seqs[5]]
    for seq in seqs[:2] + seqs[4:5]:
        scheduler.finish(seq, "stop")
    seqs[3].token_ids.append(4)  # its next token, as the engine appends it
    assert [seq for seq, _ in scheduler.schedule()] == [seqs[3], seqs[2], seqs[5]]


@pytest.fixture(scope="module")
def bad(tiny, tmp_path_factory):
    """Adapters the engine must refuse, by name: (path, the error's pattern)."""
    model = tiny[3][None]
    root = tmp_path_factory.mktemp("bad_adapters")
    made = {
        "lm_head": (dict(r=4, target_modules=["q_proj", "lm_head"]), r"target module\(s\) \['lm_head'\] not supported"),
        "saved": (dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
                  "modules_to_save .* not supported"),
        "dora": (dict(r=4, target_modules=["q_proj"], use_dora=True), "DoRA"),
        "wide": (dict(r=32, target_modules=["v_proj"]), "rank r=32 is above max_lora_rank=16; raise"),
    }
    for name, (args, _) in made.items():
        make_adapter(model, root / name, 0, **args)
    return {name: (str(root / name), pattern) for name, (_, pattern) in made.items()} | {
        "missing": (str(root / "nowhere"), "no such directory"), "empty": (str(root), "no adapter_config.json")}


@pytest.mark.parametrize("name", ["lm_head", "saved", "dora", "wide", "missing", "empty"])
def test_bad_adapters_are_refused_before_any_work(llm, tiny, bad, name):
    _, requests, expected, _ = tiny
    path, pattern = bad[name]
    loras = [requests["qv"], LoRARequest(name, 100 + list(bad).index(name), path)]
    with pytest.raises(ValueError, match=f"request 1: LoRA adapter '{name}' .*{pattern}"):
        llm.generate(workload()[:2], GREEDY, use_tqdm=False, lora_request=loras)
    still_serves(llm, tiny)


def test_bad_lora_requests(llm, tiny, bad):
    _, requests, _, _ = tiny
    completions(llm, [[1, 2]], requests["qv"])  # lora_int_id 1 is the adapter "qv"
    cases = [
        (lambda: llm.generate([[1, 2]], GREEDY, use_tqdm=False, lora_request="qv"), "must be a LoRARequest, got str"),
        (lambda: llm.generate([[1, 2]] * 2, GREEDY, use_tqdm=False, lora_request=[requests["qv"]]),
         "got 1 lora_requests for 2 prompts"),
        (lambda: llm.generate([[1, 2]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, bad["empty"][0])),
         "lora_int_id 1 names the adapter at .*: each adapter needs its own lora_int_id"),
        (lambda: LoRARequest("x", 0, "/x"), "lora_int_id must be a positive integer"),
        (lambda: LLM(tiny[0], **{**ARGS, "max_cpu_loras": 2}),
         "max_cpu_loras must be None or an integer >= max_loras=3"),
    ]
    for call, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            call()
    still_serves(llm, tiny)


def test_lora_needs_enable_lora(tiny):
    path, requests, expected, _ = tiny
    llm = LLM(path, **{k: v for k, v in ARGS.items() if "lora" not in k})
    with pytest.raises(ValueError, match="needs an engine with LoRA enabled: LLM\\(model, enable_lora=True"):
        llm.generate(workload()[:1], GREEDY, use_tqdm=False, lora_request=requests["qv"])
    engine = llm.llm_engine
    for method, arg in [("add_lora", requests["qv"]), ("remove_lora", 1), ("list_loras", None), ("pin_lora", 1)]:
        with pytest.raises(ValueError, match=f"{method} needs an engine with LoRA enabled: LLM\\(model, enable_lora="):
            getattr(engine, method)(*[arg] if arg else [])
    assert completions(llm, workload()[:2], None) == expected[None][:2]


def test_llm_engine_add_request(llm, tiny):
    _, requests, expected, _ = tiny
    engine = llm.llm_engine
    for i, name in enumerate(NAMES):
        engine.add_request(f"r{i}", workload()[i], GREEDY, lora_request=requests[name])
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step())
    assert [outputs[f"r{i}"].token_ids for i in range(3)] == [expected[name][i] for i, name in enumerate(NAMES)]


def test_bench_queues_each_prompts_adapter(llm, tiny):
    """bench.py's --profile and --step-stats queue their workload with add_requests: each prompt's
    adapter reaches the engine as its lora_request, so each completion is its adapter's."""
    from bench import add_requests
    _, requests, expected, _ = tiny
    loras, want = mixed(requests, expected)
    add_requests(llm.llm_engine, workload(), [GREEDY] * len(loras), loras)
    outputs = {}
    while llm.llm_engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in llm.llm_engine.step())
    assert [outputs[f"bench-{i}"].token_ids for i in range(len(loras))] == want


def still_serves(llm, tiny):
    """Nothing of a refused call ran or stays queued, and the engine serves the next one."""
    _, requests, expected, _ = tiny
    engine = llm.engine
    assert engine.scheduler.is_finished() and not engine.requests
    assert engine.block_manager.num_free_blocks == engine.model_runner.num_kvcache_blocks
    assert completions(llm, workload()[:2], requests["attn"]) == expected["attn"][:2]


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3},
                                  {"model": None, "num_speculative_tokens": 3}], ids=["ngram", "draft_model"])
def test_speculative_decoding_with_adapters(tiny, spec):
    """Speculation beside adapters: n-gram drafts, or the base model as a draft model (it drafts
    without adapters, the target verifies with each sequence's): greedy tokens equal those of
    the engine without speculation, adapters and base rows mixed, some drafts accepted."""
    path, requests, _, _ = tiny
    spec = spec | ({"model": path} if "model" in spec else {})
    prompts = [[5, 9, 14, 2, 77, 31] * 6, [1, 2, 3] * 10 + [8]] + workload()
    loras = [requests[NAMES[i % 3]] if i % 4 != 3 else None for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = completions(LLM(path, **ARGS), prompts, loras, params)
    llm = LLM(path, **ARGS, speculative_config=spec)
    assert completions(llm, prompts, loras, params) == plain
    assert llm.engine.spec_metrics.num_accepted_tokens > 10


# ---- vLLM's adapter calls: llm.llm_engine.add_lora, remove_lora, list_loras, pin_lora --------

def test_add_lora_loads_before_requests_and_remove_lora_drops(tiny, monkeypatch):
    """add_lora reads the adapter now (its requests read nothing); after remove_lora the next
    request reads it again and runs the same."""
    path, requests, expected, _ = tiny
    llm = LLM(path, **ARGS)
    engine, reads = llm.llm_engine, []
    load_adapter = lora_manager.load_adapter
    monkeypatch.setattr(lora_manager, "load_adapter", lambda request, *args: reads.append(request.lora_name)
                        or load_adapter(request, *args))
    qv = requests["qv"]
    assert engine.list_loras() == set()
    assert engine.add_lora(qv) is True and engine.list_loras() == {qv.lora_int_id} and reads == ["qv"]
    assert engine.add_lora(qv) and reads == ["qv"]  # already there: not read again
    assert completions(llm, workload()[:2], qv) == expected["qv"][:2] and reads == ["qv"]
    assert engine.remove_lora(qv.lora_int_id) is True and engine.list_loras() == set()
    assert engine.remove_lora(qv.lora_int_id) is False and engine.remove_lora(99) is False
    assert completions(llm, workload()[:2], qv) == expected["qv"][:2] and reads == ["qv", "qv"]
    assert engine.list_loras() == {qv.lora_int_id}


@pytest.mark.parametrize("name", ["lm_head", "saved", "wide", "missing"])
def test_add_lora_refuses_bad_adapters(llm, tiny, bad, name):
    path, pattern = bad[name]
    with pytest.raises(ValueError, match=f"LoRA adapter '{name}' .*{pattern}"):
        llm.llm_engine.add_lora(LoRARequest(name, 200, path))
    assert 200 not in llm.llm_engine.list_loras()
    still_serves(llm, tiny)


def test_remove_lora_while_its_requests_run(tiny):
    """remove_lora of a running adapter, and of an idle one whose freed slot another adapter then
    takes beside the running one: every request gets its own adapter's tokens."""
    path, requests, expected, _ = tiny
    llm = LLM(path, **{**ARGS, "max_loras": 2})
    engine, prompts = llm.llm_engine, workload()
    assert completions(llm, prompts[:2], [requests["qv"], requests["attn"]]) == [expected["qv"][0], expected["attn"][1]]
    engine.add_request("attn", prompts[2], GREEDY, lora_request=requests["attn"])  # 70 tokens: two chunks
    engine.step()
    assert engine.remove_lora(requests["qv"].lora_int_id)  # idle, its slot freed: "all" takes it, not attn's
    engine.add_request("all", prompts[3], GREEDY, lora_request=requests["all"])
    outputs = {}
    for _ in range(3):
        outputs.update((out.request_id, out.outputs[0].token_ids) for out in engine.step())
    assert engine.remove_lora(requests["attn"].lora_int_id)  # running: read again for its next step
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out.outputs[0].token_ids) for out in engine.step())
    assert outputs == {"attn": expected["attn"][2], "all": expected["all"][3]}


def test_pin_lora_keeps_an_adapter_through_lru(tiny):
    """max_cpu_loras=2: a pinned adapter stays in the host cache while others come and go; with
    both places pinned add_lora refuses another, whose requests still run (read from disk)."""
    path, requests, expected, _ = tiny
    llm = LLM(path, **{**ARGS, "max_loras": 1, "max_cpu_loras": 2})
    engine, prompts = llm.llm_engine, workload()[:2]
    with pytest.raises(ValueError, match="lora_int_id 1 is not loaded"):
        engine.pin_lora(1)
    assert engine.add_lora(requests["qv"]) and engine.pin_lora(1) is True
    for name in ("attn", "all", "attn"):
        assert completions(llm, prompts, requests[name]) == expected[name][:2]
        assert engine.list_loras() == {1, requests[name].lora_int_id}
    assert completions(llm, prompts, requests["qv"]) == expected["qv"][:2]
    assert engine.add_lora(requests["all"]) and engine.pin_lora(3) and engine.list_loras() == {1, 3}
    with pytest.raises(ValueError, match="cannot be kept: all max_cpu_loras=2 adapters of the host cache are pinned"):
        engine.add_lora(requests["attn"])
    assert completions(llm, prompts, requests["attn"]) == expected["attn"][:2]
    assert engine.list_loras() == {1, 3}
    assert engine.remove_lora(1) and engine.add_lora(requests["attn"]) and engine.list_loras() == {2, 3}


def test_adapter_calls_reach_every_rank(tiny, tmp_path):
    """TP=2: every rank's host cache follows add_lora, pin_lora and remove_lora. A rank that
    missed one would read the adapter's directory, which the test empties, then fills with
    another adapter's files."""
    path, requests, expected, _ = tiny
    llm = LLM(path, tensor_parallel_size=2, **{**ARGS, "max_loras": 1, "max_cpu_loras": 2})
    engine, own, prompts = llm.llm_engine, tmp_path / "own", workload()[:2]
    shutil.copytree(requests["qv"].lora_path, own)
    mine = LoRARequest("own", 9, str(own))
    assert engine.add_lora(mine) and engine.pin_lora(9)
    shutil.rmtree(own)  # from here on only the host caches hold it
    for name in ("attn", "all"):  # each through the slot and the cache's unpinned place
        assert completions(llm, prompts, requests[name]) == expected[name][:2]
    assert engine.list_loras() == {9, 3}
    assert completions(llm, prompts, mine) == expected["qv"][:2]
    assert engine.remove_lora(9) and engine.list_loras() == {3}
    shutil.copytree(requests["attn"].lora_path, own)
    assert llm.reset_prefix_cache()  # (its blocks were computed with the former files)
    assert completions(llm, prompts, mine) == expected["attn"][:2]
