"""Where a step's GPU memory goes: peak above weights and gradients at each length, and the
live allocations at the peak of the last length, grouped by the oomb/transformers lines that
made them (torch.cuda.memory history). For finding what grows with the context.

    python bench/memory_trace.py --offload all --chunk-size 2048 --lengths 32K,64K,128K --layers 28
"""
from __future__ import annotations

import argparse
import collections
import os

import torch

import oomb
from oomb.cli import parse_tokens
from oomb.presets import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="32K,64K")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--offload", default="all")
    ap.add_argument("--sparse", action="store_true")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_model("qwen2.5-7b", dtype=torch.bfloat16, device="cuda", num_hidden_layers=args.layers).train()
    engine = oomb.ChunkRecurrentEngine(model, kernels=oomb.KernelOptions.from_env(os.environ),
                                  chunk_size=args.chunk_size, offload=args.offload,
                                       sparse=oomb.TopKPages() if args.sparse else None)
    engine.forward_backward(torch.randint(0, 1000, (1, 8192), device="cuda"))  # grads allocated
    base = torch.cuda.memory_allocated()
    lengths = [parse_tokens(x) for x in args.lengths.split(",")]
    for n in lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, n), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if n == lengths[-1]:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        engine.forward_backward(ids)
        torch.cuda.synchronize()
        print(f"{n:>9,} tokens: peak {(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GiB above weights+grads")
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live, now, best, at_best = {}, 0, 0, {}
    for trace in snapshot["device_traces"]:
        for e in trace:
            if e["action"] == "alloc":
                live[e["addr"]] = e
                now += e["size"]
                if now > best:
                    best, at_best = now, dict(live)
            elif e["action"] == "free_completed" and e["addr"] in live:
                now -= live.pop(e["addr"])["size"]
    sizes, counts = collections.Counter(), collections.Counter()
    for e in at_best.values():
        frames = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in e["frames"]
                  if "oomb" in f["filename"] or "modeling" in f["filename"]][:3]
        key = " <- ".join(frames) or "(no Python frame: autograd engine)"
        sizes[key] += e["size"]
        counts[key] += 1
    print(f"peak of the traced allocations: {best / 2**30:.2f} GiB; live at the peak:")
    for key, size in sizes.most_common(args.top):
        print(f"{size / 2**30:8.2f} GiB {counts[key]:6d} x  {key}")


if __name__ == "__main__":
    main()
