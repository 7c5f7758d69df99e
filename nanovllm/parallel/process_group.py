"""The tensor-parallel ranks' process group: NCCL on GPUs, gloo on CPU, and the all-reduce of
the row-parallel products' partial sums. Ranks meet through a FileStore in a fresh temporary
directory: no fixed port or shared-memory name, so engines on one host never collide.

On GPUs a decode step's all-reduces (two per layer, a few KB to a few MB each) go through a
buffer in PyTorch's symmetric memory, which every rank maps: its two-shot kernel (each rank sums
its share of the peers' buffers over NVLink, then gathers the others' shares) takes 8.6-15.5 us
where NCCL's takes 16.4-37.7 (2 x H100, 1-256 rows of 1024-4096, inside CUDA graphs). In a TP=2
decode step of 256 sequences of Qwen3-8B the 73 all-reduces took 2.48 ms on NCCL and 1.47 with
their copies here; `bench.py --model qwen3-8b --tp 2` 11.17 -> 10.88 s (benchmarks/NOTES.md,
2026-11-25, eighth and ninth sessions). Larger ones (prefill) keep NCCL."""
import logging
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)
_symmetric: dict[str, object] = {}  # "buffer": this rank's symmetric-memory tensor, "group": the group's name
# PyTorch's rendezvous names its store keys by a count of the rendezvous this process has made, so
# ranks agree only while each has made as many: new worker processes have made none, so only the
# first TP engine of rank 0's process uses symmetric memory (tp_workers.TPWorkers decides).
_rendezvous_made = False


def symmetric_memory_unused() -> bool:
    """Whether this process has made no symmetric-memory rendezvous yet."""
    return not _rendezvous_made


def init_process_group(rank: int, size: int, store_path: str, device: torch.device,
                       symmetric_shape: tuple[int, int] | None = None, dtype: torch.dtype = torch.bfloat16):
    """Join the engine's process group: NCCL on CUDA (one GPU per rank), gloo on CPU.
    symmetric_shape: on CUDA, all_reduce takes tensors of up to that many rows of that width in
    `dtype` (bfloat16 or float32: PyTorch's kernels take no other) through symmetric memory; every
    rank passes it or none does (see symmetric_memory_unused).
    Raises RuntimeError if this process already belongs to another engine's group."""
    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed group: its own, or a live "
                           "tensor-parallel engine's (it leaves the group when the LLM is deleted); delete that "
                           "LLM or destroy the group first, or use another process")
    store = dist.FileStore(store_path, size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timedelta(minutes=10))
    if device.type == "cuda" and symmetric_shape and dtype in (torch.bfloat16, torch.float32):
        import torch.distributed._symmetric_memory as symm_mem
        global _rendezvous_made
        _rendezvous_made = True
        try:  # collective: every rank gets here together
            buffer = symm_mem.empty(symmetric_shape, dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, dist.group.WORLD.group_name)
        except RuntimeError as e:  # no peer access between the GPUs, say
            logger.warning("symmetric memory unavailable (%s); all-reduces use NCCL", e)
        else:
            _symmetric.update(buffer=buffer, group=dist.group.WORLD.group_name)


def all_reduce(y: torch.Tensor) -> torch.Tensor:
    """Sum y [rows, width] over the tensor-parallel ranks, in place (every rank gets the same
    sums); returns y. Through the symmetric buffer when y fits it (same dtype and width, no more
    rows), else torch.distributed's all_reduce."""
    buffer = _symmetric.get("buffer")
    if buffer is None or y.dtype != buffer.dtype or y.dim() != 2 or y.size(1) != buffer.size(1) \
            or y.size(0) > buffer.size(0):
        dist.all_reduce(y)
        return y
    shared = buffer[:y.size(0)]
    shared.copy_(y)
    torch.ops.symm_mem.two_shot_all_reduce_(shared, "sum", _symmetric["group"])
    return y.copy_(shared)


def leave_process_group(graphs: dict):
    """End this rank's part in the engine's process group: free its CUDA graphs (`graphs`, batch
    size -> torch.cuda.CUDAGraph, emptied), then destroy the group. The order matters: NCCL's
    communicator teardown waits forever while a graph that captured one of its collectives lives
    (pytorch/pytorch#115388). Every rank calls it, together, when the engine ends."""
    graphs.clear()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    _symmetric.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
