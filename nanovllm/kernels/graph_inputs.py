"""A uniform step's inputs (a decode step, or q_len new tokens per sequence) written into a CUDA
graph's static buffers by one kernel, the graph's first.

Before each replay the graph's token ids and attention metadata must hold the step's values, the
sequences past the batch padding (slot -1: no KV write; see write_graph_inputs). Done with torch
ops that is nine small kernels a step (the pending tokens' gather and scatter, the copies, the
fills); this kernel does it in one. On an H100 decode steps of 1-2 sequences took ~20 us less
(0.84 against 0.86 ms, 1.24 against 1.26), within a noisy machine's spread (docs/perf-log.md,
2026-11-25). It reads the step from a static staging area (engine/step_inputs.py GraphLayout), so
the graph holds it and a step launches nothing but its upload and the graph: the kernel's own
launch cost a verify step's host 58-85 us (H100, H200: docs/perf-log.md, 2026-11-28)."""
import torch
import triton
import triton.language as tl


@triton.jit
def graph_inputs_kernel(header_ptr, ids_ptr, pending_ptr, sampled_ptr, positions_ptr, slots_ptr, ctx_ptr, tables_ptr,
                        stride_t, g_ids_ptr, g_positions_ptr, g_slots_ptr, g_ctx_ptr, g_tables_ptr, stride_gt,
                        PLACEHOLDER: tl.constexpr, Q_LEN: tl.constexpr, BLOCK_Q: tl.constexpr,
                        PAD_CONTEXT: tl.constexpr, BLOCK_W: tl.constexpr):
    """Grid (graph batch size,): with (num_seqs, width, num_pending) = header[:3], program i writes
    sequence i's Q_LEN tokens (ids, positions, slots) and its context length and the first width
    entries of its block-table row, or padding past num_seqs (slots -1, context PAD_CONTEXT), and
    the i-th pending token, sampled[pending[i, 1]] at token pending[i, 0]; the other tokens come
    from ids (where they are not PLACEHOLDER). Block-table columns past width keep older values:
    context_lens bounds every read of them. The counts are read from memory, not passed, so that a
    CUDA graph can hold this kernel and replay it for any step of its shape."""
    row = tl.program_id(0)
    num_seqs, width, num_pending = tl.load(header_ptr), tl.load(header_ptr + 1), tl.load(header_ptr + 2)
    offs_q = tl.arange(0, BLOCK_Q)
    tokens, in_row = row * Q_LEN + offs_q, offs_q < Q_LEN
    if row < num_seqs:
        ids = tl.load(ids_ptr + tokens, mask=in_row, other=PLACEHOLDER)
        tl.store(g_ids_ptr + tokens, ids, mask=in_row & (ids != PLACEHOLDER))
        tl.store(g_positions_ptr + tokens, tl.load(positions_ptr + tokens, mask=in_row), mask=in_row)
        tl.store(g_slots_ptr + tokens, tl.load(slots_ptr + tokens, mask=in_row), mask=in_row)
        tl.store(g_ctx_ptr + row, tl.load(ctx_ptr + row))
        cols = tl.arange(0, BLOCK_W)
        for c in range(0, width, BLOCK_W):
            mask = c + cols < width
            entries = tl.load(tables_ptr + row * stride_t + c + cols, mask=mask)
            tl.store(g_tables_ptr + row * stride_gt + c + cols, entries, mask=mask)
    else:
        tl.store(g_slots_ptr + tokens, tl.full([BLOCK_Q], -1, tl.int64), mask=in_row)
        tl.store(g_ctx_ptr + row, PAD_CONTEXT)
    if row < num_pending:
        index, source = tl.load(pending_ptr + 2 * row), tl.load(pending_ptr + 2 * row + 1)
        tl.store(g_ids_ptr + index, tl.load(sampled_ptr + source))


def write_graph_inputs(staged: dict[str, torch.Tensor], sampled: torch.Tensor, graph_ids: torch.Tensor, graph_meta,
                       placeholder: int, q_len: int = 1):
    """Write a step of n <= batch_size sequences of q_len new tokens each, staged on the device,
    into a graph's static buffers. staged: header [>= 3] int64 (n, the block tables' width, the
    number P <= n of pending tokens), input_ids [batch_size * q_len] int64 (the first n * q_len
    used; `placeholder` where pending [batch_size, 2] int64 (token index, row of sampled) names the
    previous step's sampled token in sampled [rows] int64), positions and slot_mapping [batch_size *
    q_len] int64, context_lens [batch_size] int32, block_tables [batch_size, >= width] int32 (rows
    of unit stride); the graph's batch size is that of context_lens. graph_ids [>= batch_size *
    q_len] int64 and graph_meta (the backend's static AttentionMetadata, block_tables [>=
    batch_size, >= width]) receive them. Padding sequences get context length 0 when q_len is 1
    (the decode kernel gives them zeros) and q_len otherwise: the attention kernels' queries then
    see key 0, through the first entry of a block-table row, which always names a block (a
    sequence in a step holds one), where context 0 would put them before position 0."""
    tables = staged["block_tables"]
    batch_size = staged["context_lens"].size(0)
    assert tables.stride(1) == 1 and tables.size(1) <= graph_meta.block_tables.size(1)
    assert staged["input_ids"].size(0) == batch_size * q_len
    graph_inputs_kernel[(batch_size,)](
        staged["header"], staged["input_ids"], staged["pending"], sampled, staged["positions"],
        staged["slot_mapping"], staged["context_lens"], tables, tables.stride(0), graph_ids, graph_meta.positions,
        graph_meta.slot_mapping, graph_meta.context_lens, graph_meta.block_tables, graph_meta.block_tables.stride(0),
        PLACEHOLDER=placeholder, Q_LEN=q_len, BLOCK_Q=triton.next_power_of_2(q_len),
        PAD_CONTEXT=0 if q_len == 1 else q_len, BLOCK_W=64, num_warps=1)
