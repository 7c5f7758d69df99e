"""graph_inputs_kernel against the torch copies it replaces: a uniform step's ids (pending ones from the
previous step's sampled tokens) and metadata written into a graph's static buffers, padding
sequences reset, everything outside the step's rows and columns left as it was; for decode steps
(q_len 1) and for q_len new tokens per sequence (verify runs). CPU: Triton's interpreter."""
import pytest
import torch

pytest.importorskip("triton")
from nanovllm.kernels.graph_inputs import write_graph_inputs  # noqa: E402
from nanovllm.sequence import PLACEHOLDER  # noqa: E402
from nanovllm.layers.attention.base import AttentionMetadata  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def static_buffers(max_tokens, max_bs, max_blocks, gen):
    """Graph buffers holding arbitrary values from an earlier step."""
    def rand(*shape, dtype):
        return torch.randint(-5, 1000, shape, generator=gen, dtype=dtype).to(DEVICE)
    return rand(max_tokens, dtype=torch.int64), AttentionMetadata(
        rand(max_tokens, dtype=torch.int64), rand(max_tokens, dtype=torch.int64), None, rand(max_bs, dtype=torch.int32),
        rand(max_bs, max_blocks, dtype=torch.int32), 1, 1)


@pytest.mark.parametrize("n, batch_size, width, num_pending, q_len",
                         [(1, 1, 1, 1, 1), (3, 4, 70, 2, 1), (5, 8, 3, 0, 1), (16, 16, 130, 16, 1),
                          (3, 4, 70, 2, 3), (5, 8, 3, 5, 4), (2, 2, 5, 0, 2)])
def test_graph_inputs_match_the_torch_copies(n, batch_size, width, num_pending, q_len):
    gen = torch.Generator().manual_seed(n * 1000 + width + q_len)
    max_bs, max_blocks = batch_size + 3, width + 5
    graph_ids, graph_meta = static_buffers(max_bs * q_len, max_bs, max_blocks, gen)
    num_tokens = n * q_len
    sampled = torch.randint(0, 50_000, (n + 4,), generator=gen).to(DEVICE)
    ids = torch.randint(0, 50_000, (num_tokens,), generator=gen)
    index = torch.randperm(n, generator=gen)[:num_pending] * q_len + q_len - 1  # a sequence's last token pends
    pending = torch.stack([index, torch.randperm(n + 4, generator=gen)[:num_pending]], 1)
    ids[index] = PLACEHOLDER
    tables = torch.randint(0, 10_000, (n, width), generator=gen, dtype=torch.int32)
    meta = AttentionMetadata(torch.randint(0, 4096, (num_tokens,), generator=gen),
                             torch.randint(0, 99_999, (num_tokens,), generator=gen), None,
                             torch.randint(1, 4096, (n,), generator=gen, dtype=torch.int32), tables, q_len, q_len)
    meta = AttentionMetadata(*(x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in vars(meta).values()))
    ids, pending = ids.to(DEVICE), pending.to(DEVICE)

    ref_ids, ref_meta = graph_ids.clone(), AttentionMetadata(*(x.clone() if isinstance(x, torch.Tensor) else x
                                                               for x in vars(graph_meta).values()))
    ref_ids[:num_tokens] = ids
    ref_ids[pending[:, 0]] = sampled[pending[:, 1]]
    ref_meta.positions[:num_tokens] = meta.positions
    ref_meta.slot_mapping[:batch_size * q_len] = -1
    ref_meta.slot_mapping[:num_tokens] = meta.slot_mapping
    ref_meta.context_lens[:batch_size] = 0 if q_len == 1 else q_len  # padding: see write_graph_inputs
    ref_meta.context_lens[:n] = meta.context_lens
    ref_meta.block_tables[:n, :width] = meta.block_tables

    write_graph_inputs(batch_size, ids, pending if num_pending else None, sampled, meta, graph_ids, graph_meta,
                       PLACEHOLDER, q_len)
    assert torch.equal(graph_ids, ref_ids)  # padding sequences' ids as they were
    assert (graph_ids[:num_tokens] != PLACEHOLDER).all()
    for name in ("positions", "slot_mapping", "context_lens", "block_tables"):
        assert torch.equal(getattr(graph_meta, name), getattr(ref_meta, name)), name


def test_a_graphs_static_metadata_written_onto_itself_stays_as_it_was():
    """What CUDAGraphRunner.capture does for each (batch size, q_len) to compile the kernel before any
    generate call: every buffer keeps its values."""
    from nanovllm.layers.attention.base import AttentionBackend
    gen = torch.Generator().manual_seed(7)
    backend = AttentionBackend()
    backend.init_graph_state(8, 6, [1, 5], torch.device(DEVICE))
    for buffer in (backend.graph_meta.positions, backend.graph_meta.slot_mapping, backend.graph_meta.context_lens,
                   backend.graph_meta.block_tables):
        buffer.copy_(torch.randint(0, 1000, buffer.shape, generator=gen))
    ids = torch.randint(0, 50_000, (40,), generator=gen).to(DEVICE)
    for batch_size, q_len in ((8, 1), (3, 1), (8, 5), (2, 5)):
        meta = backend.graph_metadata(batch_size, q_len)
        before = [x.clone() for x in (ids, *(getattr(backend.graph_meta, n) for n in
                                            ("positions", "slot_mapping", "context_lens", "block_tables")))]
        write_graph_inputs(batch_size, ids[:batch_size * q_len], None, None, meta, ids, backend.graph_meta,
                           PLACEHOLDER, q_len)
        after = (ids, *(getattr(backend.graph_meta, n) for n in ("positions", "slot_mapping", "context_lens",
                                                                 "block_tables")))
        assert all(torch.equal(a, b) for a, b in zip(after, before)), (batch_size, q_len)
