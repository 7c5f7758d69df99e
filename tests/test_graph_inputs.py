"""graph_inputs_kernel against the torch copies it replaces: a decode step's ids (pending ones from the
previous step's sampled tokens) and metadata written into a graph's static buffers, padding rows
reset, everything outside the step's rows and columns left as it was. CPU: Triton's interpreter."""
import pytest
import torch

pytest.importorskip("triton")
from nanovllm.kernels.graph_inputs import write_graph_inputs  # noqa: E402
from nanovllm.sequence import PLACEHOLDER  # noqa: E402
from nanovllm.layers.attention.base import AttentionMetadata  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def static_buffers(max_bs, max_blocks, gen):
    """Graph buffers holding arbitrary values from an earlier step."""
    def rand(*shape, dtype):
        return torch.randint(-5, 1000, shape, generator=gen, dtype=dtype).to(DEVICE)
    return rand(max_bs, dtype=torch.int64), AttentionMetadata(
        rand(max_bs, dtype=torch.int64), rand(max_bs, dtype=torch.int64), None, rand(max_bs, dtype=torch.int32),
        rand(max_bs, max_blocks, dtype=torch.int32), 1, True)


@pytest.mark.parametrize("n, batch_size, width, num_pending",
                         [(1, 1, 1, 1), (3, 4, 70, 2), (5, 8, 3, 0), (16, 16, 130, 16)])
def test_graph_inputs_match_the_torch_copies(n, batch_size, width, num_pending):
    gen = torch.Generator().manual_seed(n * 1000 + width)
    max_bs, max_blocks = batch_size + 3, width + 5
    graph_ids, graph_meta = static_buffers(max_bs, max_blocks, gen)
    sampled = torch.randint(0, 50_000, (n + 4,), generator=gen).to(DEVICE)
    ids = torch.randint(0, 50_000, (n,), generator=gen)
    index = torch.randperm(n, generator=gen)[:num_pending]
    pending = torch.stack([index, torch.randperm(n + 4, generator=gen)[:num_pending]], 1)
    ids[index] = PLACEHOLDER
    tables = torch.randint(0, 10_000, (n, width), generator=gen, dtype=torch.int32)
    meta = AttentionMetadata(torch.randint(0, 4096, (n,), generator=gen), torch.randint(0, 99_999, (n,), generator=gen),
                             None, torch.randint(1, 4096, (n,), generator=gen, dtype=torch.int32), tables, 1, True)
    meta = AttentionMetadata(*(x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in vars(meta).values()))
    ids, pending = ids.to(DEVICE), pending.to(DEVICE)

    ref_ids, ref_meta = graph_ids.clone(), AttentionMetadata(*(x.clone() if isinstance(x, torch.Tensor) else x
                                                               for x in vars(graph_meta).values()))
    ref_ids[:n] = ids
    ref_ids[pending[:, 0]] = sampled[pending[:, 1]]
    ref_meta.positions[:n] = meta.positions
    ref_meta.slot_mapping[:batch_size] = -1
    ref_meta.slot_mapping[:n] = meta.slot_mapping
    ref_meta.context_lens[:batch_size] = 0
    ref_meta.context_lens[:n] = meta.context_lens
    ref_meta.block_tables[:n, :width] = meta.block_tables

    write_graph_inputs(batch_size, ids, pending if num_pending else None, sampled, meta, graph_ids, graph_meta, PLACEHOLDER)
    assert torch.equal(graph_ids[:n], ref_ids[:n]) and torch.equal(graph_ids[batch_size:], ref_ids[batch_size:])
    assert (graph_ids[:n] != PLACEHOLDER).all()
    for name in ("positions", "slot_mapping", "context_lens", "block_tables"):
        assert torch.equal(getattr(graph_meta, name), getattr(ref_meta, name)), name
