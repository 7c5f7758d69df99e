"""The tensor-parallel ranks' process group: NCCL on GPUs, gloo on CPU, and the sums of the
row-parallel products' partial sums. Ranks meet through a FileStore in a fresh temporary
directory: no fixed port or shared-memory name, so engines on one host never collide.

With tensor parallelism every row-parallel product (o_proj, down_proj) and the embedding leave
each rank's partial sums, and the RMSNorm after them sums those first (all_reduce_rms_norm). With
two GPUs, a step of up to max_num_seqs rows does it in one kernel (all_reduce_norm_kernel): each
product writes into one of three buffers, and the norm's kernel pushes them over NVLink into the
peer's box of that slot, in PyTorch's symmetric memory, which both ranks map, and sums them with
what the peer pushed into its own. In a TP=2 decode step of 256 sequences of Qwen3-8B (2 x H100)
the 73 sums took 2.48 ms in NCCL's all-reduces, 1.47 in PyTorch's two-shot symmetric-memory
all-reduce with its copies, and 1.02 in this kernel when it read the peer's buffer after a
meeting, norms included (docs/perf-log.md, 2026-11-25); pushing took a third off a call at
Qwen3-30B-A3B's shape (kernels/all_reduce_norm.py). Larger steps (prefill, up to
max_num_batched_tokens rows) send their partial sums to the peer through the copy engines instead
(send_partial_sums), chunk by chunk while the product computes the next chunk, so the transfer
leaves the SMs to the products; NCCL's all_reduce shares them and runs after each product. More
ranks, float32 and CPUs use torch.distributed's all_reduce, then the norm."""
import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)
SEND_CHUNKS, SEND_CHUNK_MIN_ROWS = 4, 1024  # 8 chunks measured no better
# Which symmetric buffer each product that leaves partial sums writes: consecutive sums never share
# a buffer, so a rank never overwrites the one its peer may still be reading.
O_PROJ_SLOT, DOWN_PROJ_SLOT, EMBEDDING_SLOT = 0, 1, 2
# PyTorch's rendezvous names its store keys by a count of the rendezvous this process has made (a
# process-wide count of PyTorch's own), so ranks agree only while each has made as many: new worker
# processes have made none, so only the first TP engine of rank 0's process uses symmetric memory
# (executor/tp_workers.TPWorkers decides, through symmetric_memory_unused).
_rendezvous_made = False


def symmetric_memory_unused() -> bool:
    """Whether this process has made no symmetric-memory rendezvous yet."""
    return not _rendezvous_made


@dataclass
class SymmetricBuffers:
    """Two ranks' shared memory: this rank's three [max_rows, hidden] partial-sum buffers (one per
    slot, local); its three boxes of that shape, in symmetric memory, where the peer pushes its
    partial sums for the one-kernel sum (boxes), and the peer's boxes mapped here (peer_boxes); two
    [max_tokens, hidden] inboxes the peer's copy engine writes (inboxes) and the peer's that this
    rank writes (peer_inboxes), with their [2] int32 flags; the copy stream."""
    rank: int
    buffers: list
    boxes: list
    peer_boxes: list
    inboxes: list
    peer_inboxes: list
    copy_flags: torch.Tensor
    peer_copy_flags: torch.Tensor
    copy_stream: torch.cuda.Stream
    next_inbox: int = 0


class TPGroup:
    """This rank's part in an engine's tensor-parallel process group, handed to the layers that sum
    partial products (through TensorParallel.group). symmetric: the two-GPU buffers, or None."""

    def __init__(self, rank: int, size: int, symmetric: SymmetricBuffers | None):
        self.rank, self.size, self.symmetric = rank, size, symmetric
        self._sent: list = []  # [a product's output, its inbox] between send_partial_sums and its norm

    def partial_sums_buffer(self, rows: int, dtype: torch.dtype, slot: int) -> torch.Tensor | None:
        """Where a product of `rows` rows in `dtype` should write this rank's partial sums for
        all_reduce_rms_norm to sum them in one kernel: buffer `slot` (O_PROJ_SLOT,
        DOWN_PROJ_SLOT, EMBEDDING_SLOT) as [rows, hidden_size]; None when that path does not apply
        (no symmetric memory, more rows, another dtype)."""
        sym = self.symmetric
        if sym is None or dtype != sym.buffers[slot].dtype or rows > sym.buffers[slot].size(0):
            return None
        return sym.buffers[slot][:rows]

    def send_partial_sums(self, x: torch.Tensor, width: int, product) -> torch.Tensor:
        """A row-parallel product of more rows than partial_sums_buffer takes (a prefill step):
        product(x_rows, out=out_rows) over up to SEND_CHUNKS row chunks of x [rows, in], each chunk
        copied into the peer's inbox by the copy engine (a side stream) as soon as its product is
        done, while the next chunk's product runs; after the last, a signal to the peer. Returns this
        rank's [rows, width] partial sums in x's dtype, which all_reduce_rms_norm sums with the peer's
        from this rank's inbox once the peer's signal arrives. Without the inboxes, or for more rows
        than they hold, it returns product(x) for torch.distributed's all_reduce.
        The inboxes alternate, so a rank writes one only after the peer's norm has read it: to send
        call n + 2 it has passed its norm n + 1, which waited for the peer's call n + 1, which the
        peer queued after its norm n."""
        sym, rows = self.symmetric, x.size(0)
        if sym is None or rows > sym.peer_inboxes[0].size(0) or x.dtype != sym.peer_inboxes[0].dtype:
            return product(x)
        from nanovllm.kernels.all_reduce_norm import signal_kernel
        inbox, sym.next_inbox = sym.next_inbox, 1 - sym.next_inbox
        out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
        compute, copy = torch.cuda.current_stream(), sym.copy_stream
        chunks = max(1, min(SEND_CHUNKS, rows // SEND_CHUNK_MIN_ROWS))
        bounds = [rows * i // chunks for i in range(chunks + 1)]
        for start, end in zip(bounds, bounds[1:]):
            product(x[start:end], out=out[start:end])
            copy.wait_stream(compute)
            with torch.cuda.stream(copy):
                sym.peer_inboxes[inbox][start:end].copy_(out[start:end])  # a peer-to-peer memcpy over NVLink
        with torch.cuda.stream(copy):
            signal_kernel[(1,)](sym.peer_copy_flags[sym.rank:], num_warps=1)
        out.record_stream(copy)
        self._sent[:] = [out, inbox]
        return out

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                            norm) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(r), r) for r = (x summed over the ranks) + residual (or no residual: None), where x
        [rows, hidden_size] is this rank's partial sums and norm a layernorm.RMSNorm. One kernel when
        x is the partial_sums_buffer it was written to; when x is send_partial_sums' output, one
        kernel after the wait for the peer's signal; else torch.distributed's all_reduce (in place),
        then the norm."""
        sym = self.symmetric
        slot = next((i for i, b in enumerate(sym.buffers) if x.data_ptr() == b.data_ptr()), None) if sym else None
        sent = bool(self._sent) and self._sent[0] is x
        if slot is None and not sent:
            dist.all_reduce(x)
            return (norm(x), x) if residual is None else norm(x, residual)
        from nanovllm.kernels.all_reduce_norm import all_reduce_rms_norm_2, wait_kernel
        if slot is not None:
            return all_reduce_rms_norm_2(x, sym.boxes[slot], sym.peer_boxes[slot], residual, norm.weight, norm.eps)
        inbox = self._sent[1]
        self._sent.clear()
        wait_kernel[(1,)](sym.copy_flags[1 - sym.rank:], num_warps=1)
        return all_reduce_rms_norm_2(x, sym.inboxes[inbox], None, residual, norm.weight, norm.eps)

    def leave(self, graphs: dict):
        """End this rank's part in the group: free its CUDA graphs (`graphs`, (batch size, q_len) ->
        torch.cuda.CUDAGraph, emptied), then destroy the group. The order matters: NCCL's
        communicator teardown waits forever while a graph that captured one of its collectives lives
        (pytorch/pytorch#115388). Every rank calls it, together, when the engine ends."""
        graphs.clear()
        self._sent.clear()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.symmetric = None
        if dist.is_initialized():
            dist.destroy_process_group()


def init_process_group(rank: int, size: int, store_path: str, device: torch.device,
                       symmetric_shape: tuple[int, int, int] | None = None,
                       dtype: torch.dtype = torch.bfloat16) -> TPGroup:
    """Join the engine's process group: NCCL on CUDA (one GPU per rank), gloo on CPU; returns this
    rank's TPGroup. symmetric_shape: (max_rows, max_tokens, hidden_size) (max_num_seqs,
    max_num_batched_tokens): with two CUDA ranks and a 16-bit dtype, partial sums of up to
    max_rows rows in `dtype` are summed through symmetric memory (see TPGroup.partial_sums_buffer),
    and of up to max_tokens rows sent through the copy engines (send_partial_sums); every rank
    passes it or none does (see symmetric_memory_unused). Raises RuntimeError if this process already belongs to another
    engine's group."""
    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed group: its own, or a live "
                           "tensor-parallel engine's (it leaves the group when the LLM is deleted); delete that "
                           "LLM or destroy the group first, or use another process")
    store = dist.FileStore(store_path, size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timedelta(minutes=10))
    symmetric = None
    if device.type == "cuda" and symmetric_shape and size == 2 and dtype in (torch.bfloat16, torch.float16):
        symmetric = _symmetric_buffers(rank, device, symmetric_shape, dtype)
    return TPGroup(rank, size, symmetric)


def _symmetric_buffers(rank: int, device: torch.device, shape: tuple[int, int, int],
                       dtype: torch.dtype) -> SymmetricBuffers | None:
    """The two ranks' symmetric buffers, made together (collective); None when the GPUs cannot map
    each other's memory (then all-reduces use NCCL)."""
    global _rendezvous_made
    _rendezvous_made = True
    max_rows, max_tokens, hidden = shape
    try:
        boxes = [_mapped((max_rows, hidden), dtype, device, rank) for _ in range(3)]
        inboxes = [_mapped((max_tokens, hidden), dtype, device, rank) for _ in range(2)]
        copy_flags, peer_copy_flags = _mapped((2,), torch.int32, device, rank)
    except RuntimeError as e:  # no peer access between the GPUs, say
        logger.warning("symmetric memory unavailable (%s); all-reduces use NCCL", e)
        return None
    from nanovllm.kernels.all_reduce_norm import EMPTY_BITS
    for box, _ in boxes:
        box.view(torch.int16).fill_(EMPTY_BITS)
    copy_flags.zero_()
    torch.cuda.synchronize(device)
    dist.barrier(device_ids=[device.index])  # both ranks' boxes are empty and flags zero before either kernel runs
    return SymmetricBuffers(rank, [torch.empty(max_rows, hidden, dtype=dtype, device=device) for _ in range(3)],
                            [b for b, _ in boxes], [p for _, p in boxes], [b for b, _ in inboxes], [p for _, p in inboxes], copy_flags, peer_copy_flags,
                            torch.cuda.Stream(device))


def _mapped(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A new tensor in this rank's symmetric memory and the other rank's twin, mapped here."""
    import torch.distributed._symmetric_memory as symm_mem
    mine = symm_mem.empty(shape, dtype=dtype, device=device)
    return mine, symm_mem.rendezvous(mine, dist.group.WORLD.group_name).get_buffer(1 - rank, shape, dtype)
