"""GPU time by kernel in a torch profiler Chrome trace (bench.py --profile DIR writes DIR/trace.json
of 6 engine steps): each kernel's, copy's and memset's time per step, launches per step and mean
duration, largest first, and the GPU's busy time and span per step. Durations of kernels
launched with programmatic dependent launch (kernels/pdl.py) include their wait for the kernel
before them, so their busy time can exceed the span.

    python benchmarks/trace_summary.py DIR/trace.json [--steps 6] [--rows 25]
"""
import argparse
import collections
import json


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=6, help="engine steps in the trace (bench.py profiles 6)")
    p.add_argument("--rows", type=int, default=25)
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
    print(f"{'us/step':>10} {'per step':>8} {'us each':>9}  kernel")
    for name, (us, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:args.rows]:
        print(f"{us / n:10.1f} {count / n:8.1f} {us / count:9.2f}  {name}")


if __name__ == "__main__":
    main()
