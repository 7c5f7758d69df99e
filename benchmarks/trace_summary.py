"""GPU time by kernel in a torch profiler Chrome trace (bench.py --profile DIR writes DIR/trace.json
of 6 engine steps): each kernel's, copy's and memset's time per step, launches per step and mean
duration, largest first, and the GPU's busy time and span per step. Durations of kernels
launched with programmatic dependent launch (kernels/pdl.py) include their wait for the kernel
before them, so their busy time can exceed the span. --span splits the span instead: in start
order each event is charged the time by which it moves the latest end so far (its part of the
span that nothing earlier covers), and the GPU's idle time before it; at one sequence, where the
kernels of a step run one after another, that is each kernel's cost to the step. --order N
also lists N consecutive launches from the middle of the trace with those parts, to tell apart
the kernels that share a name (a layer's products are all gemv_kernel at one sequence).

    python benchmarks/trace_summary.py DIR/trace.json [--steps 6] [--rows 25] [--span [--order N]]
"""
import argparse
import collections
import json


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=6, help="engine steps in the trace (bench.py profiles 6)")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--span", action="store_true", help="each kernel's part of the span and the idle time before it")
    p.add_argument("--order", type=int, default=0, help="with --span: list this many launches in order")
    args = p.parse_args()
    with open(args.trace) as f:
        events = [e for e in json.load(f)["traceEvents"]
                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not events:
        raise SystemExit(f"{args.trace}: no GPU events (a CUDA run of bench.py --profile writes them)")
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        by_name[e["name"][:90]][0] += e["dur"]
        by_name[e["name"][:90]][1] += 1
    busy = sum(e["dur"] for e in events)
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    n = args.steps
    print(f"GPU busy {busy / n:.1f} us/step, span {span / n:.1f} us/step, {len(events) / n:.0f} launches/step")
    if args.span:
        return span_table(events, n, args.rows, args.order)
    print(f"{'us/step':>10} {'per step':>8} {'us each':>9}  kernel")
    for name, (us, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:args.rows]:
        print(f"{us / n:10.1f} {count / n:8.1f} {us / count:9.2f}  {name}")


def span_table(events, steps, rows, order=0):
    """Print, per kernel name, its part of the span and the GPU's idle time before it (us a step,
    over `steps` steps), for events: the trace's GPU events (ts, dur in us), the first `rows` names;
    then `order` consecutive events from the middle of the trace, each with its start (from the
    first listed), duration, part of the span and idle time before it."""
    by_name = collections.defaultdict(lambda: [0.0, 0.0, 0])
    events = sorted(events, key=lambda e: e["ts"])
    end = events[0]["ts"]
    parts = []
    for e in events:
        part, gap = max(0.0, e["ts"] + e["dur"] - max(end, e["ts"])), max(0.0, e["ts"] - end)
        row = by_name[e["name"][:90]]
        row[0] += part
        row[1] += gap
        row[2] += 1
        parts.append((part, gap))
        end = max(end, e["ts"] + e["dur"])
    idle = sum(row[1] for row in by_name.values())
    print(f"idle {idle / steps:.1f} us/step; each kernel's part of the span and the idle time before it:")
    print(f"{'us/step':>10} {'idle':>8} {'per step':>8}  kernel")
    for name, (us, gap, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:rows]:
        print(f"{us / steps:10.1f} {gap / steps:8.1f} {count / steps:8.1f}  {name}")
    if order:
        first = len(events) // 2
        print(f"{'start':>9} {'us':>7} {'part':>7} {'idle':>7}  kernel, {order} launches in order")
        for e, (part, gap) in list(zip(events, parts))[first:first + order]:
            print(f"{e['ts'] - events[first]['ts']:9.2f} {e['dur']:7.2f} {part:7.2f} {gap:7.2f}  {e['name'][:70]}")

if __name__ == "__main__":
    main()
