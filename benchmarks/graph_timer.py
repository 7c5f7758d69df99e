"""The benchmarks' timer for work that runs as a CUDA graph (as the engine's decode steps do)."""
import torch


def graph_us(fn, reps: int = 30) -> float:
    """Microseconds per replay of a CUDA graph of fn() (warmed up on a side stream first, then
    captured and replayed three times before `reps` timed replays, between CUDA events)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps
