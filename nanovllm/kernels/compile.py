import functools

import torch


def token_compile(fn):
    """torch.compile(fn) on CUDA (eager elsewhere) with dim 0 of its tensor arguments, the token
    count, dynamic and every other dim static. With dynamic=True inductor also indexes by symbolic
    widths: silu_and_mul of 16,384 tokens moved 1.64 TB/s that way and 2.89 with static widths, on
    an H100 (docs/perf-log.md, 2026-11-24). Each width, dtype and rank then
    compiles once, and once more for one token (Qwen3: 4 compiles of RMSNorm, 2 of silu_and_mul
    per model); past dynamo's recompile limit (8 per function) it runs fn eagerly: the same
    values, slower. Positional arguments only."""
    if not torch.cuda.is_available():
        return fn
    compiled = torch.compile(fn)

    @functools.wraps(fn)
    def wrapper(*args):
        for a in args:
            if isinstance(a, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return compiled(*args)
    return wrapper
