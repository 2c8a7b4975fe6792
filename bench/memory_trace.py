"""Where a step's GPU memory goes: peak above weights and gradients at each length, and the
live allocations at the peak of the last length, grouped by the oomb/transformers lines that
made them (torch.cuda.memory history). For finding what grows with the context.

    python bench/memory_trace.py --offload all --chunk-size 2048 --lengths 32K,64K,128K --layers 28
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import oomb
from oomb.presets import load_model
from oomb.units import parse_tokens

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import peak_allocations  # noqa: E402


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
    peak, sites = peak_allocations(snapshot)
    print(f"peak of the traced allocations: {peak / 2**30:.2f} GiB; live at the peak:")
    for key, (size, count) in sites[:args.top]:
        print(f"{size / 2**30:8.2f} GiB {count:6d} x  {key}")


if __name__ == "__main__":
    main()
