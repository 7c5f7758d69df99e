"""The tensor-parallel ranks' process group: NCCL on GPUs, gloo on CPU. Ranks meet through a
FileStore in a fresh temporary directory: no fixed port or shared-memory name, so engines on
one host never collide."""
from datetime import timedelta

import torch
import torch.distributed as dist


def init_process_group(rank: int, size: int, store_path: str, device: torch.device):
    """Join the engine's process group: NCCL on CUDA (one GPU per rank), gloo on CPU.
    Raises RuntimeError if this process already belongs to another engine's group."""
    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed group: its own, or a live "
                           "tensor-parallel engine's (it leaves the group when the LLM is deleted); delete that "
                           "LLM or destroy the group first, or use another process")
    store = dist.FileStore(store_path, size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timedelta(minutes=10))


def leave_process_group(graphs: dict):
    """End this rank's part in the engine's process group: free its CUDA graphs (`graphs`, batch
    size -> torch.cuda.CUDAGraph, emptied), then destroy the group. The order matters: NCCL's
    communicator teardown waits forever while a graph that captured one of its collectives lives
    (pytorch/pytorch#115388). Every rank calls it, together, when the engine ends."""
    graphs.clear()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.destroy_process_group()
