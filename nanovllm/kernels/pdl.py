"""Programmatic dependent launch (PDL; CUDA 12, compute capability 9.0+): a kernel launched with it
may be scheduled while the kernel before it on the stream is still finishing, so the launch
latency between two dependent kernels, which a CUDA graph does not remove, overlaps the first
one's tail. Such a kernel must not touch anything the previous kernel writes before
griddepcontrol.wait returns (which waits for that kernel's completion and memory); our kernels
call pdl_start first thing, so nothing of theirs runs early but their launch. Measured on an H100
(a CUDA graph of 28 layers' four one-row GEMVs with real data dependencies): 19.55 -> 16.87 us
per layer, ~0.7 us per kernel (docs/perf-log.md, 2026-11-24)."""
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def num_sms(device_index: int) -> int:
    """The streaming multiprocessors of CUDA device `device_index`."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def hopper(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0+ (Hopper or newer)."""
    return device.type == "cuda" and _supported(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device: torch.device) -> dict:
    """The launch arguments of a kernel that takes PDL: tl.constexpr and calls pdl_start: PDL on
    CUDA devices of compute capability 9.0+, off elsewhere (older GPUs, Triton's CPU interpreter)."""
    on = hopper(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """First thing in a kernel: let the next kernel launch, then wait for the previous one."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
