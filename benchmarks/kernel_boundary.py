"""What one step of a chain of dependent phases costs on the GPU, two ways: a CUDA graph of
--phases small kernels launched with PDL (as a decode step of one sequence chains its ~6 kernels
per layer), against one persistent kernel of one program per SM that separates the same phases by
a grid-wide barrier (an atomic counter in global memory; what a per-layer "megakernel" would pay
instead of a kernel boundary). In every phase each program writes a float and reads its
neighbour's from the phase before, so the data dependency is real. us per phase.

    python benchmarks/kernel_boundary.py [--phases 168]
"""
import argparse

import torch
import triton
import triton.language as tl
from decode_gemm import LAYERS, time_graph

from nanovllm.kernels.pdl import pdl_args, pdl_start


@triton.jit
def phase_kernel(buf_ptr, phase, num_programs, PDL: tl.constexpr):
    """One phase: program p reads slot (p + 1) of the previous phase's row and writes its own."""
    pdl_start(PDL)
    p = tl.program_id(0)
    prev = tl.load(buf_ptr + (phase % 2) * num_programs + (p + 1) % num_programs)
    tl.store(buf_ptr + ((phase + 1) % 2) * num_programs + p, prev + 1.0)


@triton.jit
def persistent_kernel(buf_ptr, counter_ptr, phases, num_programs):
    """All phases in one launch; every program must be resident at once (one per SM)."""
    p = tl.program_id(0)
    for phase in range(phases):
        prev = tl.load(buf_ptr + (phase % 2) * num_programs + (p + 1) % num_programs, volatile=True)
        tl.store(buf_ptr + ((phase + 1) % 2) * num_programs + p, prev + 1.0)
        tl.atomic_add(counter_ptr, 1, sem="release")  # arrive, then wait for every program of the phase
        target = (phase + 1) * num_programs
        while tl.atomic_add(counter_ptr, 0, sem="acquire") < target:
            pass


def graph_us(fn):
    """GPU us of one fn() replayed in a CUDA graph (decode_gemm.time_graph, fn on its first call only)."""
    return time_graph(lambda i: fn() if i == 0 else None, reps=50) * LAYERS


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", type=int, default=168, help="6 kernels per layer x 28 layers by default")
    phases = p.parse_args().phases
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    buf = torch.zeros(2 * programs, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")

    def kernels():
        for i in range(phases):
            phase_kernel[(programs,)](buf, i, programs, **pdl_args(buf.device))

    def persistent():
        counter.zero_()
        persistent_kernel[(programs,)](buf, counter, phases, programs)

    buf.zero_()
    persistent()
    torch.cuda.synchronize()
    assert buf[phases % 2 * programs:][:programs].eq(phases).all(), "a phase read a slot before it was written"
    chain = graph_us(kernels)
    one = graph_us(persistent)
    print(f"{programs} programs, {phases} phases: {chain / phases:.2f} us per phase as PDL kernels in a graph, "
          f"{one / phases:.2f} us as grid barriers in one persistent kernel", flush=True)


if __name__ == "__main__":
    main()
