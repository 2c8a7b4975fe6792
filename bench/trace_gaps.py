"""Where a profiled step's GPU time goes, from a torch.profiler trace (bench_step.py --profile):
how busy each CUDA stream is, how long the compute stream sits idle and what the copy streams
and the host were doing meanwhile: the idle time before each kernel (what the stream waited to
start) and the host operations that overlapped the idle stretches (host-bound, or waiting on a
copy); and the GPU time by the host operation that launched it (which op's kernels grow when
two profiles differ). Traces are too big to bring back from the GPU machine, so this runs
there and prints a summary of a few KiB.

    python bench/bench_step.py --impls oomb-sparse-all --lengths 64K --kv-grad-dtype bf16 --profile /tmp/prof
    python bench/trace_gaps.py /tmp/prof
"""
from __future__ import annotations

import argparse
import bisect
import glob
import json
import os
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
              "cudaStreamWaitEvent")


def load_events(path: str) -> list[dict]:
    """Complete ('X') events of a trace file, or of the newest trace in a directory."""
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.json")), key=os.path.getmtime)
        if not files:
            raise SystemExit(f"no *.json trace in {path}")
        path = files[-1]
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def gaps(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Idle stretches between the busy intervals of one stream."""
    out, end = [], None
    for lo, hi in sorted(intervals):
        if end is not None and lo > end:
            out.append((end, lo))
        end = hi if end is None else max(end, hi)
    return out


def overlap(intervals: list[tuple[float, float]], window: tuple[float, float]) -> float:
    lo, hi = window
    return union_length([(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi])


def _top(totals: dict[str, float], top: int, ms: float) -> list[tuple[str, float]]:
    return sorted(((n, t * ms) for n, t in totals.items()), key=lambda x: -x[1])[:top]


def gpu_time_by_op(events: list[dict], top: int = 8) -> list[tuple[str, float]]:
    """GPU milliseconds by the host operation that launched them: each kernel, memcpy or
    memset is matched to its launch call (the `correlation` id), and that to the innermost
    operator around the call on its thread, named with its parent ("parent > op") so that,
    say, the copies inside an autograd node's backward stay apart from the forward's."""
    gpu = [e for e in events if e.get("cat") in GPU_CATS and "correlation" in e.get("args", {})]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops_by_tid: dict = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation") and not e["name"].startswith("ProfilerStep"):
            ops_by_tid[e.get("tid")].append(e)
    launched_by: dict[int, str] = {}
    for tid, ops in ops_by_tid.items():
        calls = sorted((e["ts"], e["args"]["correlation"]) for e in launches.values() if e.get("tid") == tid)
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        i = 0
        for ts, corr in calls:  # a sweep: the operators open at each call, innermost last
            while i < len(ops) and ops[i]["ts"] <= ts:
                while stack and stack[-1]["ts"] + stack[-1]["dur"] < ops[i]["ts"]:
                    stack.pop()
                stack.append(ops[i])
                i += 1
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < ts:
                stack.pop()
            if stack:
                names = [e["name"] for e in stack[-2:]]
                launched_by[corr] = " > ".join(names)
    totals: dict[str, float] = defaultdict(float)
    for e in gpu:
        totals[launched_by.get(e["args"]["correlation"], "?")] += e["dur"]
    return _top(totals, top, 1e-3)


def summarize(events: list[dict], top: int = 8) -> dict:
    by_stream: dict[int, list[tuple[float, float]]] = defaultdict(list)
    names: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    host_waits: dict[str, float] = defaultdict(float)
    kernels: dict[int, list[tuple[float, str]]] = defaultdict(list)  # (start, name) per stream
    host_ops = []
    for e in events:
        if e.get("cat") in GPU_CATS:
            stream = e.get("args", {}).get("stream", -1)
            by_stream[stream].append((e["ts"], e["ts"] + e["dur"]))
            names[stream][e["name"]] += e["dur"]
            kernels[stream].append((e["ts"], e["name"]))
        elif e.get("cat") == "cuda_runtime" and e["name"] in HOST_WAITS:
            host_waits[e["name"]] += e["dur"]
        if e.get("cat") in ("cpu_op", "cuda_runtime") and not e["name"].startswith("ProfilerStep"):
            host_ops.append((e["ts"], e["ts"] + e["dur"], e["name"]))  # (the whole step says nothing)
    if not by_stream:
        raise SystemExit("the trace has no GPU events (was CUDA activity profiled?)")
    start = min(lo for iv in by_stream.values() for lo, _ in iv)
    end = max(hi for iv in by_stream.values() for _, hi in iv)
    compute = max(by_stream, key=lambda s: sum(hi - lo for lo, hi in by_stream[s]))
    others = [iv for s, ivs in by_stream.items() if s != compute for iv in ivs]
    idle = gaps(by_stream[compute])
    ms = 1e-3  # trace times are in microseconds
    # The kernel each idle stretch ended with, and the host operations it overlapped (nested
    # operations each count their own overlap).
    starts = dict(sorted(kernels[compute]))
    before: dict[str, float] = defaultdict(float)
    host_in_gaps: dict[str, float] = defaultdict(float)
    for lo, hi in idle:
        before[starts.get(hi, "?")] += hi - lo
    ends = [hi for _, hi in idle]  # idle stretches are disjoint and sorted
    for a, b, name in host_ops:
        i = bisect.bisect_right(ends, a)  # the first stretch ending after the operation starts
        while i < len(idle) and idle[i][0] < b:
            lo, hi = idle[i]
            host_in_gaps[name] += min(b, hi) - max(a, lo)
            i += 1
    return {
        "span_ms": (end - start) * ms,
        "compute_stream": compute,
        "streams": {s: {"busy_ms": union_length(iv) * ms, "busy_frac": union_length(iv) / (end - start),
                        "top": _top(names[s], top, ms)}
                    for s, iv in sorted(by_stream.items())},
        "compute_idle_ms": sum(hi - lo for lo, hi in idle) * ms,
        "compute_idle_while_copies_ms": sum(overlap(others, g) for g in idle) * ms,
        "longest_gaps_ms": sorted(((hi - lo) * ms for lo, hi in idle), reverse=True)[:top],
        "idle_before_ms": _top(before, top, ms),
        "host_during_idle_ms": _top(host_in_gaps, top, ms),
        "host_waits_ms": {n: t * ms for n, t in sorted(host_waits.items(), key=lambda x: -x[1])},
        "gpu_by_op_ms": gpu_time_by_op(events, top),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a trace .json, or the --profile directory (its newest trace)")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    s = summarize(load_events(args.trace), args.top)
    print(f"GPU span {s['span_ms']:.1f} ms; compute stream {s['compute_stream']} idle {s['compute_idle_ms']:.1f} ms, "
          f"of which {s['compute_idle_while_copies_ms']:.1f} ms with other streams busy")
    print("longest compute-stream gaps (ms):", ", ".join(f"{g:.2f}" for g in s["longest_gaps_ms"]))
    print("compute-stream idle before these kernels (ms):")
    for name, t in s["idle_before_ms"]:
        print(f"  {t:10.1f} ms  {name[:100]}")
    print("host operations during the idle stretches (ms, nested ones each counted):")
    for name, t in s["host_during_idle_ms"]:
        print(f"  {t:10.1f} ms  {name[:100]}")
    for stream, st in s["streams"].items():
        print(f"\nstream {stream}: busy {st['busy_ms']:.1f} ms ({st['busy_frac']:.0%})")
        for name, t in st["top"]:
            print(f"  {t:10.1f} ms  {name[:100]}")
    print("\nGPU time by the host operation that launched it (ms, all streams; 'parent > op'):")
    for name, t in s["gpu_by_op_ms"]:
        print(f"  {t:10.1f} ms  {name[:140]}")
    print("\nhost waits (ms):", json.dumps({n: round(t, 1) for n, t in s["host_waits_ms"].items()}))


if __name__ == "__main__":
    main()
