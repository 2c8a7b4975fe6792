"""Host<->GPU page transfers: the zero-copy gather/scatter kernel that offload uses for sparse
selections (`oomb.memory.offload.copy_rows`, scattered pinned-host rows) against `copy_` of a
contiguous pinned range (the copy engines), in GB/s.

    python bench/bench_copy.py            # 256 rows of one Qwen2.5-7B page (4 x 128 x 128)
    python bench/bench_copy.py --programs 8,16,32   # the gather/scatter on fewer programs (SMs)

A copy program waiting on PCIe holds an SM that a GEMM's block (a whole SM's registers) cannot
share, so the fewest programs that still fill the link are the best for a step that overlaps
copies with compute.
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch

from oomb.memory import offload
from oomb.memory.offload import copy_rows


def gbps(fn, n_bytes: int, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return n_bytes * reps / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--host-rows", type=int, default=8192)
    ap.add_argument("--row-elems", type=int, default=4 * 128 * 128)
    ap.add_argument("--programs", default=str(offload.COPY_PROGRAMS),
                    help="comma-separated program counts of the gather/scatter kernel to time")
    args = ap.parse_args()
    for programs, dtype in itertools.product(map(int, args.programs.split(",")), (torch.bfloat16, torch.float32)):
        offload.COPY_PROGRAMS = programs
        host = torch.randn(args.host_rows, args.row_elems).to(dtype).pin_memory()
        dev = torch.empty(args.rows, args.row_elems, dtype=dtype, device="cuda")
        rows = torch.randperm(args.host_rows)[: args.rows].cuda()
        n_bytes = dev.numel() * dev.element_size()
        gather = gbps(lambda: copy_rows(host, rows, dev, None), n_bytes)
        assert torch.equal(dev.cpu(), host[rows.cpu()])
        scatter = gbps(lambda: copy_rows(dev, None, host, rows), n_bytes)
        contiguous = gbps(lambda: dev.copy_(host[: args.rows], non_blocking=True), n_bytes)
        print(f"{programs} programs, {dtype}: gather {gather:.1f} GB/s, scatter {scatter:.1f} GB/s, contiguous copy_ {contiguous:.1f} GB/s")


if __name__ == "__main__":
    main()
