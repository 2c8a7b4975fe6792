"""What adding one chunk's parameter gradient costs, by how it is added (GPU): bf16 += bf16 (what
autograd does into a bf16 .grad), fp32 += bf16 with torch's add_ (the engine's fp32 gradient sums,
param_grad_dtype=torch.float32), and the same add through torch.compile (one fused, vectorised
kernel). Bytes moved per element: 6 for the bf16 add, 10 for the fp32 sums; the table gives GB/s
against the GPU's ~4.8 TB/s.

Why: fp32 gradient sums cost +7 % of a sparse 64K step (9.84 -> 10.51 s), ~42 ms a chunk where 4 more
bytes per parameter predict ~10 ms; a mixed-dtype add_ that does not vectorise would explain it.

    python bench/grad_add.py --sizes 68M,545M   # an MLP weight of Qwen2.5-7B, its embedding
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import record, run_info  # noqa: E402

from oomb.cli import parse_tokens  # noqa: E402


def timed(fn, cuda: bool, repeat: int = 20) -> float:
    """Median seconds of fn() (CUDA events on the GPU)."""
    fn()
    times = []
    for _ in range(repeat):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def add_into(total: torch.Tensor, grad: torch.Tensor) -> None:
    total.add_(grad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="68M,545M", help="elements per gradient (K/M suffixes: 2**10, 2**20)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "grad_add.jsonl"))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (no compiled way)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("grad_add.py times GPU kernels: run it on the GPU machine (or --device cpu for a smoke run)")
    info = run_info()
    for n in (parse_tokens(x) for x in args.sizes.split(",")):
        grad = torch.randn(n, device=args.device).bfloat16()
        ways = {"bf16 += bf16": (torch.zeros(n, dtype=torch.bfloat16, device=args.device), add_into, 6),
                "fp32 += bf16 (add_)": (torch.zeros(n, device=args.device), add_into, 10)}
        if cuda:
            ways["fp32 += bf16 (compiled)"] = (torch.zeros(n, device=args.device),
                                               torch.compile(add_into, dynamic=True), 10)
        for name, (total, fn, per_element) in ways.items():
            s = timed(lambda: fn(total, grad), cuda)
            record(args.out, {"bench": "grad_add", "way": name, "elements": n, "ms": round(s * 1e3, 3),
                              "gb_s": float(f"{per_element * n / s / 1e9:.4g}"), **info})  # 4 digits: a slow CPU smoke run stays > 0


if __name__ == "__main__":
    main()
