"""A step's inputs: planned on the host (StepPlan) and staged to the device in two copies."""
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from nanovllm.sequence import PLACEHOLDER, Sequence


@dataclass
class StepPlan:
    """One step's inputs as host arrays (int64), T tokens of S sequences; what rank 0 sends to
    the other tensor-parallel ranks, with input_ids and pending left out (the ids are broadcast)."""
    input_ids: np.ndarray | None  # [T]; PLACEHOLDER where the previous step's sampled token goes
    pending: np.ndarray | None  # [P, 2]: (token index, row of the previous step's sampled tokens)
    positions: np.ndarray  # [T]
    cu_seqlens_q: np.ndarray  # [S + 1]
    context_lens: np.ndarray  # [S]: tokens in the cache after this step
    slot_mapping: np.ndarray  # [T]: KV cache slot of each new token
    block_tables: np.ndarray  # [S, max blocks], -1 padded
    sample_rows: np.ndarray  # [R] token rows whose logits are sampled, each sequence's in position order
    num_sampled: np.ndarray  # [S]: positions each sequence samples, its last ones (0: none; 1 + k verifying k drafts)
    uniform_q_len: int | None  # every sequence's number of new tokens when they are all equal (1: a decode step)
    max_seqlen_q: int
    num_decodes: int  # the leading sequences with one new token each (all of them in a decode step)
    block_copies: np.ndarray  # [C, 2]: (source, destination) KV blocks to copy after the forward
    prompt_rows: np.ndarray  # [Q] token rows whose logits give prompt logprobs (prompt_logprobs)
    prompt_targets: np.ndarray  # [Q]: the prompt token after each of those rows
    num_prompt_logprobs: int  # top tokens to return with them
    lora: object = None  # the step's LoRA adapters (engine/lora_manager.py LoRAStep), or None

    INT32 = ("cu_seqlens_q", "context_lens", "block_tables")  # the rest go up as int64

    @property
    def is_decode(self) -> bool:
        """One new token per sequence: the decode kernels and the q_len 1 CUDA graphs."""
        return self.uniform_q_len == 1


def plan_step(scheduled: list[tuple[Sequence, int]], block_size: int, prev_rows: dict[int, int],
              forks: dict[int, list[Sequence]] | None = None, block_copies: list[tuple[int, int]] = (),
              drafts: dict[int, list[int]] | None = None, lookahead: int = 0
              ) -> tuple[StepPlan, list[Sequence], list[tuple], list[tuple]]:
    """Pack the scheduled (sequence, new tokens) pairs into a StepPlan; also returns the sequence of
    each sampled row, in row order. The rule for which rows sample lives here: a sequence samples
    when its new tokens reach its end, and so do the sequences forked from it this step
    (forks: seq_id -> children, for SamplingParams.n), from the same logits row. A sequence with
    drafts (seq_id -> draft token ids, which its scheduled tokens count after its own) runs them
    after its tokens and samples 1 + k positions, the logits of its last token and of each draft:
    k + 1 consecutive rows, its sequence once per row. A PLACEHOLDER input token is the previous
    step's sampled token of that sequence, at row prev_rows[seq_id] of its sampled tensor. Also
    returns, for prompt_logprobs, (sequence, first position, count) of the plan's prompt_rows, in
    order: row p's logits give the logprob of prompt token p + 1; and the verify runs, (sequence,
    its first row, its drafts) each. lookahead: block tables wide enough for that many tokens more
    (a draft model's chain of steps, ModelRunner.run_chain). Index math is vectorised."""
    num_seqs = len(scheduled)
    ends = [seq.num_computed_tokens for seq, _ in scheduled]
    width = -(-(max(ends) + lookahead) // block_size)
    block_tables = np.full((num_seqs, width), -1, np.int64)
    cu_q, counts = [0], []
    input_ids, pending, samples, sampled, runs = [], [], [], [], []
    prompt_rows, prompt_targets, prompt_spans, num_prompt_logprobs = [], [], [], 0
    for i, ((seq, n), end) in enumerate(zip(scheduled, ends)):  # plain Python: numpy costs ~1 us a call here
        start = end - n
        counts.append(n)
        cu_q.append(cu_q[-1] + n)
        table = seq.block_table[:width]
        block_tables[i, :len(table)] = table
        input_ids.extend(seq.token_ids[start:end])
        if input_ids[-1] == PLACEHOLDER:
            pending.append((len(input_ids) - 1, prev_rows[seq.seq_id]))
        if end == len(seq):
            samples.append(i)
            sampled.append(seq)
            for child in forks.get(seq.seq_id, ()) if forks else ():
                samples.append(i)
                sampled.append(child)
        elif drafts and (run := drafts.get(seq.seq_id)) is not None:
            assert end == len(seq) + len(run), "a sequence's drafts run whole, in the step after its last token"
            input_ids.extend(run)
            runs.append((seq, len(sampled), run))
            samples.extend([i] * (len(run) + 1))
            sampled.extend([seq] * (len(run) + 1))
        if seq.sampling_params.prompt_logprobs is not None:
            first, last = start, min(end, seq.num_prompt_tokens - 1)
            if last > first:
                prompt_rows.extend(range(cu_q[i], cu_q[i] + last - first))
                prompt_targets.extend(seq.token_ids[first + 1:last + 1])
                prompt_spans.append((seq, first, last - first))
                num_prompt_logprobs = max(num_prompt_logprobs, seq.sampling_params.prompt_logprobs)
    uniform_q_len = int(counts[0]) if counts.count(counts[0]) == num_seqs else None
    num_decodes = num_seqs if uniform_q_len == 1 else next(i for i, n in enumerate(counts) if n != 1)
    context_lens = np.array(ends, np.int64)
    max_seqlen_q, cu_q, counts = int(max(counts)), np.array(cu_q, np.int64), np.array(counts, np.int64)
    seq_of_token = np.repeat(np.arange(num_seqs), counts)
    positions = np.arange(cu_q[-1]) - cu_q[seq_of_token] + (context_lens - counts)[seq_of_token]
    slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    samples = np.array(samples, np.int64)
    sample_rows, num_sampled = cu_q[samples + 1] - 1, np.zeros(num_seqs, np.int64)
    num_sampled[samples] = 1
    for _, first, run in runs:  # a run's rows: its last k + 1 tokens, the last one's already set
        k = len(run)
        sample_rows[first:first + k + 1] = sample_rows[first + k] - np.arange(k, -1, -1)
        num_sampled[samples[first]] = k + 1
    plan = StepPlan(np.array(input_ids, np.int64), np.array(pending, np.int64).reshape(-1, 2), positions, cu_q,
                    context_lens, slot_mapping, block_tables, sample_rows, num_sampled, uniform_q_len, max_seqlen_q,
                    num_decodes, np.array(block_copies, np.int64).reshape(-1, 2), np.array(prompt_rows, np.int64),
                    np.array(prompt_targets, np.int64), num_prompt_logprobs)
    return plan, sampled, prompt_spans, runs


def draft_offsets(runs: list[tuple], num_rows: int) -> list[int] | None:
    """For each of a step's num_rows sampled rows, how many of its sequence's drafts come before the
    position it samples (row j of a verify run: j; other rows 0); None without runs (plan_step's)."""
    if not runs:
        return None
    offsets = [0] * num_rows
    for _, first, run in runs:
        offsets[first:first + len(run) + 1] = range(len(run) + 1)
    return offsets


class GraphLayout:
    """Where a graphed step's inputs lie in the static staging area its CUDA graph reads
    (CUDAGraphRunner; the graph's first kernel, kernels/graph_inputs.py, copies them into its
    buffers), for a graph of batch_size sequences of q_len tokens and block tables of max_blocks
    columns: header [4] int64 (the step's sequences, block-table width, pending tokens, 0),
    input_ids [batch_size * q_len], pending [batch_size, 2], positions and slot_mapping [batch_size
    * q_len] (int64), context_lens [batch_size] and block_tables [batch_size, max_blocks] (int32),
    each 16-byte aligned from byte 0; a step fills the first rows of each."""
    FIELDS = (("header", torch.int64), ("input_ids", torch.int64), ("pending", torch.int64),
              ("positions", torch.int64), ("slot_mapping", torch.int64), ("context_lens", torch.int32),
              ("block_tables", torch.int32))

    def __init__(self, batch_size: int, q_len: int, max_blocks: int):
        tokens = batch_size * q_len
        shapes = dict(header=(4,), input_ids=(tokens,), pending=(batch_size, 2), positions=(tokens,),
                      slot_mapping=(tokens,), context_lens=(batch_size,), block_tables=(batch_size, max_blocks))
        self.fields, offset = [], 0  # (name, dtype, shape, byte offset)
        for name, dtype in self.FIELDS:
            self.fields.append((name, dtype, shapes[name], offset))
            offset += -(-math.prod(shapes[name]) * dtype.itemsize // 16) * 16
        self.nbytes, self.max_blocks = offset, max_blocks
        self._at = {name: offset // dtype.itemsize for name, dtype, _, offset in self.fields}  # in elements of its dtype

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each field, whole, as a view of buffer (uint8 from byte 0: the staging area)."""
        return {name: buffer[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                for name, dtype, shape, offset in self.fields}

    def fill(self, host: np.ndarray, plan: StepPlan, pending: bool):
        """Write plan's step into host (uint8, from byte 0, a multiple of 8 bytes) at the fields'
        places: the header and the rows the step fills (its pending tokens only if `pending`;
        input_ids unless None: a tensor-parallel worker's, which rank 0 broadcasts into the staging
        area). A step's host time is in such calls: one numpy view per dtype, one store a field."""
        (n, width), at = plan.block_tables.shape, self._at
        num_pending = len(plan.pending) if pending and plan.pending is not None else 0
        h64, h32 = host.view(np.int64), host.view(np.int32)
        h64[at["header"]:at["header"] + 3] = (n, width, num_pending)
        for name, values in (("input_ids", plan.input_ids), ("positions", plan.positions),
                             ("slot_mapping", plan.slot_mapping), ("pending", plan.pending if num_pending else None)):
            if values is not None:
                h64[at[name]:at[name] + values.size] = values.ravel()
        h32[at["context_lens"]:at["context_lens"] + n] = plan.context_lens
        rows = h32[at["block_tables"]:at["block_tables"] + n * self.max_blocks].reshape(n, self.max_blocks)
        rows[:, :width] = plan.block_tables

    def step_views(self, buffer: torch.Tensor, plan: StepPlan, pending: bool) -> dict[str, torch.Tensor]:
        """What a graphed step reads back of its staged fields, as views of buffer (uint8, from byte 0):
        input_ids (its n * q_len tokens: rank 0 may fill in pending ones, or broadcast them) and,
        where the graph gathers them, pending [P, 2]."""
        b64, at, num_tokens = buffer.view(torch.int64), self._at, len(plan.positions)
        out = {"input_ids": b64[at["input_ids"]:at["input_ids"] + num_tokens]}
        if pending and plan.pending is not None and len(plan.pending):
            out["pending"] = b64[at["pending"]:at["pending"] + 2 * len(plan.pending)].view(-1, 2)
        return out


class Stager:
    """Copies a step's host arrays to the device in one transfer. On CUDA they are packed into one
    of two pinned buffers, used in turn, and copied asynchronously; a buffer is refilled only after
    its last copy has run (its event), since steps that sample nothing (prompt chunks) and
    tensor-parallel workers may run ahead of the GPU. Every array starts 16-byte aligned: Triton
    compiles a kernel anew for a pointer that is not."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.stream = torch.cuda.current_stream(device)  # Event.record() would look it up: ~30 us
            self._slots = [[torch.empty(0, dtype=torch.uint8), torch.cuda.Event()] for _ in range(2)]

    def upload(self, arrays: list[np.ndarray], dtypes: list[torch.dtype], base: int = 0,
               fill: Callable[[np.ndarray], None] | None = None,
               dest: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The host arrays on the device, each as its dtype (values cast as numpy casts them), from
        byte `base` of the transfer, whose first bytes fill(host bytes) writes. The transfer goes
        to dest's first bytes where given (uint8: a static buffer, which the caller orders after its
        last reader), else to a new tensor."""
        nbytes = [a.size * d.itemsize for a, d in zip(arrays, dtypes)]
        starts = [base]
        for n in nbytes:
            starts.append(starts[-1] + -(-n // 16) * 16)
        total = starts[-1]
        assert dest is None or dest.numel() >= total, f"a step's inputs ({total} bytes) overflow their staging area"
        if self.device.type != "cuda":
            flat = torch.empty(total, dtype=torch.uint8)
            host = flat.numpy()
        else:
            self._slots.reverse()
            slot = self._slots[0]
            slot[1].synchronize()
            if slot[0].numel() < total:  # grows during the start-up warm-up (the largest step), rarely later
                slot[0] = torch.empty(2 * total, dtype=torch.uint8, pin_memory=True)
            host = slot[0].numpy()
        if fill is not None:
            fill(host)
        for a, d, start, n in zip(arrays, dtypes, starts, nbytes):
            host[start:start + n].view(_NUMPY[d])[:] = a.ravel()
        if self.device.type == "cuda":
            source = slot[0][:total]
            if dest is None:
                flat = source.to(self.device, non_blocking=True)
            else:
                flat = dest[:total].copy_(source, non_blocking=True)
            slot[1].record(self.stream)
        elif dest is not None:
            flat = dest[:total].copy_(flat)
        typed = {d: flat.view(d) for d in set(dtypes)}  # then one slice an array: a step's host time is in torch calls
        out = [typed[d][start // d.itemsize:(start + n) // d.itemsize] for d, start, n in zip(dtypes, starts, nbytes)]
        return [x if a.ndim == 1 else x.view(a.shape) for x, a in zip(out, arrays)]

    def upload_plan(self, plan: StepPlan, extra: dict[str, np.ndarray], layout: GraphLayout | None = None,
                    dest: torch.Tensor | None = None, pending_in_graph: bool = True) -> dict[str, torch.Tensor]:
        """Every non-empty array of the plan on the device, by field name (StepPlan.INT32 as int32,
        the rest int64; an empty one, such as prompt_rows in most steps, is left out: every use is
        behind a length check of the plan's), and those of `extra` (the attention backend's,
        AttentionBackend.host_arrays) as int32, in the same transfer. A step that replays a CUDA
        graph: layout, the graph's GraphLayout, and dest, its staging area: the graph's inputs go
        to their places there (pending ones only if pending_in_graph, else after them with the
        rest), the other arrays after them; of the graph's inputs only GraphLayout.step_views' are
        returned."""
        in_graph = () if layout is None else (("input_ids", "positions", "slot_mapping", "context_lens", "block_tables")
                                              + (("pending",) if pending_in_graph else ()))
        arrays = {n: a for n in ("input_ids", "pending", "positions", "slot_mapping", "sample_rows", "prompt_rows",
                                 "prompt_targets", "block_copies", *StepPlan.INT32)
                  if n not in in_graph and (a := getattr(plan, n)) is not None and a.size}
        dtypes = [torch.int32 if n in StepPlan.INT32 else torch.int64 for n in arrays] + [torch.int32] * len(extra)
        arrays |= extra
        if layout is None:
            return dict(zip(arrays, self.upload(list(arrays.values()), dtypes)))
        out = self.upload(list(arrays.values()), dtypes, layout.nbytes,
                          lambda host: layout.fill(host, plan, pending_in_graph), dest)
        return dict(zip(arrays, out)) | layout.step_views(dest, plan, pending_in_graph)


_NUMPY = {torch.int32: np.int32, torch.int64: np.int64}
