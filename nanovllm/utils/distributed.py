"""Tensor-parallel state and process plumbing shared by the engine's processes.

Layers read this process's tensor-parallel rank and size when they are built (`tp_rank_and_size`),
not from torch.distributed, so an engine with tensor_parallel_size=1 ignores any process group.
Ranks meet through a FileStore in a fresh temporary directory: no fixed port or shared-memory
name, so engines on one host never collide.
"""
import ctypes
import os
import signal
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

_tp = (0, 1)  # (rank, size) of the model being built in this process


def tp_rank_and_size() -> tuple[int, int]:
    return _tp


@contextmanager
def tensor_parallel(rank: int, size: int):
    """Layers built inside take (rank, size) as their tensor-parallel position."""
    global _tp
    previous, _tp = _tp, (rank, size)
    try:
        yield
    finally:
        _tp = previous


def check_tensor_parallel(hf_config, tp_size: int):
    """Raise ValueError unless the model splits evenly over tp_size ranks: query heads and the
    intermediate size divisible by it, and KV heads either divisible by it or dividing it (then
    each KV head is replicated on tp_size / num_key_value_heads ranks)."""
    if tp_size == 1:
        return
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % tp_size or hf_config.intermediate_size % tp_size or (kv_heads % tp_size and tp_size % kv_heads):
        raise ValueError(f"tensor_parallel_size={tp_size} does not split this model: it needs to divide "
                         f"num_attention_heads={heads} and intermediate_size={hf_config.intermediate_size}, and "
                         f"to divide or be a multiple of num_key_value_heads={kv_heads}")


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


def die_with_parent(parent_pid: int):
    """Have the kernel kill this process when its parent exits, however it exits (Linux
    prctl PR_SET_PDEATHSIG); Ctrl-C is left to the parent, which stops its children itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent's pipe closing still ends the child's loop
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def stop_processes(procs, conns, timeout: float):
    """Send None (the exit message) on each pipe, give the processes `timeout` seconds in all to
    exit, then kill the rest."""
    for conn in conns:
        try:
            conn.send(None)
            conn.close()
        except OSError:
            pass  # the process is already gone
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
