"""A graphed step's inputs: staged by the Stager at a GraphLayout's places, then written by
graph_inputs_kernel into a graph's static buffers, against the torch copies that kernel replaces: ids
(pending ones from the previous step's sampled tokens) and metadata, padding sequences reset,
everything outside the step's rows and columns left as it was; for decode steps (q_len 1) and for
q_len new tokens per sequence (verify runs). CPU: Triton's interpreter."""
import numpy as np
import pytest
import torch

pytest.importorskip("triton")
from nanovllm.engine.step_inputs import GraphLayout, Stager, StepPlan  # noqa: E402
from nanovllm.kernels.graph_inputs import write_graph_inputs  # noqa: E402
from nanovllm.layers.attention.base import AttentionMetadata  # noqa: E402
from nanovllm.sequence import PLACEHOLDER  # noqa: E402
from tests.conftest import needs_interpreter, random_prompts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def static_buffers(max_tokens, max_bs, max_blocks, gen):
    """Graph buffers holding arbitrary values from an earlier step."""
    def rand(*shape, dtype):
        return torch.randint(-5, 1000, shape, generator=gen, dtype=dtype).to(DEVICE)
    return rand(max_tokens, dtype=torch.int64), AttentionMetadata(
        rand(max_tokens, dtype=torch.int64), rand(max_tokens, dtype=torch.int64), None, rand(max_bs, dtype=torch.int32),
        rand(max_bs, max_blocks, dtype=torch.int32), 1, 1)


def make_plan(n, width, num_pending, q_len, gen, sampled_rows):
    """A StepPlan of n sequences of q_len tokens, the last token of num_pending of them pending."""
    num_tokens = n * q_len
    ids = torch.randint(0, 50_000, (num_tokens,), generator=gen)
    index = torch.randperm(n, generator=gen)[:num_pending] * q_len + q_len - 1  # a sequence's last token pends
    pending = torch.stack([index, torch.randperm(sampled_rows, generator=gen)[:num_pending]], 1)
    ids[index] = PLACEHOLDER
    cu = np.arange(0, num_tokens + 1, q_len)
    return StepPlan(ids.numpy(), pending.numpy(), torch.randint(0, 4096, (num_tokens,), generator=gen).numpy(), cu,
                    torch.randint(1, 4096, (n,), generator=gen).numpy(),
                    torch.randint(0, 99_999, (num_tokens,), generator=gen).numpy(),
                    torch.randint(0, 10_000, (n, width), generator=gen).numpy(), cu[1:] - 1, np.ones(n, np.int64),
                    q_len, q_len, n if q_len == 1 else 0, np.zeros((0, 2), np.int64), np.zeros(0, np.int64),
                    np.zeros(0, np.int64), 0)


@pytest.mark.parametrize("n, batch_size, width, num_pending, q_len",
                         [(1, 1, 1, 1, 1), (3, 4, 70, 2, 1), (5, 8, 3, 0, 1), (16, 16, 130, 16, 1),
                          (3, 4, 70, 2, 3), (5, 8, 3, 5, 4), (2, 2, 5, 0, 2), (0, 4, 0, 0, 1)])
def test_graph_inputs_match_the_torch_copies(n, batch_size, width, num_pending, q_len):
    """n = 0: what a graph's capture stages (padding only)."""
    gen = torch.Generator().manual_seed(n * 1000 + width + q_len)
    max_bs, max_blocks = batch_size + 3, width + 5
    graph_ids, graph_meta = static_buffers(max_bs * q_len, max_bs, max_blocks, gen)
    sampled = torch.randint(0, 50_000, (n + 4,), generator=gen).to(DEVICE)
    layout = GraphLayout(batch_size, q_len, max_blocks)
    staging = torch.randint(0, 256, (layout.nbytes + 4096,), generator=gen, dtype=torch.uint8).to(DEVICE)  # stale bytes
    plan = make_plan(n, width, num_pending, q_len, gen, n + 4)
    num_tokens = n * q_len
    tensors = Stager(torch.device(DEVICE)).upload_plan(plan, {}, layout, staging)
    staged = layout.views(staging)
    assert staged["header"][:3].tolist() == [n, width, num_pending]
    for name, rows in (("input_ids", num_tokens), ("pending", num_pending), ("positions", num_tokens),
                       ("slot_mapping", num_tokens), ("context_lens", n)):
        assert np.array_equal(staged[name][:rows].cpu().numpy(), getattr(plan, name)), name
    assert np.array_equal(staged["block_tables"][:n, :width].cpu().numpy(), plan.block_tables)
    for name in ("input_ids", "pending", "sample_rows", "cu_seqlens_q"):  # what the engine reads back
        if name in tensors:
            assert np.array_equal(tensors[name].cpu().numpy(), getattr(plan, name)), name
    assert ("pending" in tensors) == (num_pending > 0) and "positions" not in tensors

    ids = torch.from_numpy(plan.input_ids).to(DEVICE)
    pending = torch.from_numpy(plan.pending).to(DEVICE)
    ref_ids, ref_meta = graph_ids.clone(), AttentionMetadata(*(x.clone() if isinstance(x, torch.Tensor) else x
                                                               for x in vars(graph_meta).values()))
    ref_ids[:num_tokens] = torch.where(ids == PLACEHOLDER, ref_ids[:num_tokens], ids)
    ref_ids[pending[:, 0]] = sampled[pending[:, 1]]
    ref_meta.positions[:num_tokens] = torch.from_numpy(plan.positions)
    ref_meta.slot_mapping[:batch_size * q_len] = -1
    ref_meta.slot_mapping[:num_tokens] = torch.from_numpy(plan.slot_mapping)
    ref_meta.context_lens[:batch_size] = 0 if q_len == 1 else q_len  # padding: see write_graph_inputs
    ref_meta.context_lens[:n] = torch.from_numpy(plan.context_lens)
    ref_meta.block_tables[:n, :width] = torch.from_numpy(plan.block_tables)

    write_graph_inputs(staged, sampled, graph_ids, graph_meta, PLACEHOLDER, q_len)
    assert torch.equal(graph_ids, ref_ids)  # padding sequences' ids as they were
    assert (graph_ids[:num_tokens] != PLACEHOLDER).all()
    for name in ("positions", "slot_mapping", "context_lens", "block_tables"):
        assert torch.equal(getattr(graph_meta, name), getattr(ref_meta, name)), name


def test_pending_tokens_outside_the_graph():
    """Under tensor parallelism rank 0 fills in pending tokens before it broadcasts the ids: they go
    up with the step's other arrays, and the header counts none for the graph to gather."""
    gen = torch.Generator().manual_seed(3)
    layout, plan = GraphLayout(4, 1, 8), make_plan(3, 5, 2, 1, gen, 7)
    staging = torch.zeros(layout.nbytes + 4096, dtype=torch.uint8, device=DEVICE)
    tensors = Stager(torch.device(DEVICE)).upload_plan(plan, {}, layout, staging, pending_in_graph=False)
    assert np.array_equal(tensors["pending"].cpu().numpy(), plan.pending)
    assert layout.views(staging)["header"][:3].tolist() == [3, 5, 0]
    assert tensors["pending"].data_ptr() >= staging.data_ptr() + layout.nbytes  # after the graph's fields


def test_a_staging_area_too_small_is_refused():
    gen = torch.Generator().manual_seed(4)
    layout, plan = GraphLayout(4, 1, 8), make_plan(3, 5, 0, 1, gen, 7)
    with pytest.raises(AssertionError, match="overflow their staging area"):
        Stager(torch.device(DEVICE)).upload_plan(plan, {}, layout, torch.zeros(layout.nbytes, dtype=torch.uint8))


@needs_interpreter
def test_graphed_steps_through_a_stand_in_for_cuda_graphs(tiny_qwen3, monkeypatch):
    """The engine's graph path on CPU, each CUDA graph stood in for by the calls its capture made,
    run again at each replay on the same tensors (the static buffers and the staging area, as a
    graph's kernels keep their pointers): the staging, the graphs' own input kernel and the pending
    tokens' gather, in decode steps and in verify steps of n-gram drafts (Triton's interpreter),
    give the eager engine's greedy tokens."""
    import contextlib
    from nanovllm import LLM, SamplingParams
    from nanovllm.engine import cuda_graphs
    from nanovllm.engine.cuda_graphs import CUDAGraphRunner

    class StandIn:
        def __init__(self):
            self.calls = []

        def pool(self):
            return None

        def replay(self):
            for call in self.calls:
                call()

    capturing, forward = [], CUDAGraphRunner._forward

    @contextlib.contextmanager
    def graph(stand_in, pool=None):
        capturing.append(stand_in)
        yield
        capturing.pop()

    def recorded(self, *args):
        if capturing:
            capturing[-1].calls.append(lambda: forward(self, *args))
        forward(self, *args)

    monkeypatch.setattr(cuda_graphs.torch.cuda, "CUDAGraph", StandIn)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "graph", graph)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(CUDAGraphRunner, "_forward", recorded)
    path, _ = tiny_qwen3
    motif = random_prompts([6], seed=8)[0]
    prompts = [motif * 4, *random_prompts([9, 21], seed=9), motif * 3 + [5]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    args = dict(device="cpu", kvcache_block_size=16, attention_backend="triton", max_num_seqs=4, max_model_len=128)
    expected = [o.outputs[0].token_ids for o in LLM(path, **args).generate(prompts, params, use_tqdm=False)]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    for spec in (None, ngram):
        llm = LLM(path, **args, speculative_config=spec)
        r = llm.engine.model_runner
        r.graph_runner = runner = CUDAGraphRunner(r.model, r.backend, r.config, r.max_blocks_per_seq,
                                                  r.hf_config.hidden_size, r.model.lm_head.logits_width, r.dtype,
                                                  r.device, {})
        runner.capture()
        if spec:  # as the engine sets it up where the runner has graphs: every decoding row takes k drafts
            llm.engine.speculator.uniform = True
        replayed, replay = [], runner.replay
        runner.replay = lambda key, *a: replayed.append(key) or replay(key, *a)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected, spec
        assert any(q == 1 for _, q in replayed) and (spec is None or any(q == 4 for _, q in replayed)), replayed
