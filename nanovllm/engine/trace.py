"""Named regions of a step (scheduling, prepare_inputs, forward, compute_logits, sampling) for
torch profiler traces (bench.py --profile)."""
import contextlib

import torch
from torch.profiler import record_function


def region(name: str):
    """record_function(name) while a torch profiler records, else nothing: record_function costs
    ~18 us a use even when no profiler runs (a 2-core Xeon, torch 2.13), ~0.1 ms a step at six."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()
