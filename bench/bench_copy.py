"""Host<->GPU page transfers: the zero-copy gather/scatter kernel that offload uses for sparse
selections in stage 1 (`oomb.memory.dma.copy_rows`, scattered pinned-host rows), the copy
engines' batched copy it uses in stage 2 (`oomb.memory.dma`, one cuMemcpyBatchAsync per
transfer) and `copy_` of a contiguous pinned range, in GB/s.

    python bench/bench_copy.py            # 256 rows of one Qwen2.5-7B page (4 x 128 x 128)
    python bench/bench_copy.py --programs 8,16,32   # the gather/scatter on fewer programs (SMs)
    python bench/bench_copy.py --gemm               # a layer's GEMMs beside a running gather

A copy program waiting on PCIe holds an SM that a GEMM's block (a whole SM's registers) cannot
share, so the fewest programs that still fill the link are the best for a step that overlaps
copies with compute. `--gemm` times the GEMMs of a Qwen2.5-7B layer (a 4,096-token chunk: forward,
input and weight gradients) alone and while the gather kernel runs on another stream, with cuBLAS
free to use every SM or told to leave the copy's SMs (`torch._C._set_sm_carveout_experimental`;
cuBLASLt honours it, so the GEMMs go through cuBLASLt): a GEMM sized to fill every SM in one wave
needs a second wave when some SMs are held; and beside the same gather on the copy engines.
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch

from oomb.memory import dma as dma_module
from oomb.memory.dma import batch_copier, copy_rows, row_copies


def gbps(fn, n_bytes: int, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return n_bytes * reps / (time.perf_counter() - t0) / 1e9


def gemm_ms(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def gemms_beside_copies(programs: int, tokens: int = 4096, hidden: int = 3584, mlp: int = 18944) -> None:
    """Each GEMM of a 7B layer: ms alone and beside a gather, without and with an SM carveout."""
    dma_module.COPY_PROGRAMS = programs
    dev = torch.device("cuda")
    t = lambda *shape: torch.randn(*shape, device=dev, dtype=torch.bfloat16)  # noqa: E731
    x, h, w_up, w_down, w_q = t(tokens, hidden), t(tokens, mlp), t(mlp, hidden), t(hidden, mlp), t(hidden, hidden)
    g_up = t(tokens, mlp)
    shapes = {
        "x @ Wup^T (fwd)": lambda: torch.nn.functional.linear(x, w_up),
        "h @ Wdown^T (fwd)": lambda: torch.nn.functional.linear(h, w_down),
        "x @ Wq^T (fwd)": lambda: torch.nn.functional.linear(x, w_q),
        "dY @ Wup (dX)": lambda: g_up @ w_up,
        "dY^T @ x (dW)": lambda: g_up.t() @ x,
    }
    row_elems = 4 * 128 * 128
    host = torch.empty(8192, row_elems, dtype=torch.bfloat16).pin_memory()
    staging = torch.empty(2048, row_elems, dtype=torch.bfloat16, device=dev)
    rows = torch.randperm(8192, device=dev)[:2048]
    host_rows = rows.cpu().numpy()
    dma = batch_copier()
    side = torch.cuda.Stream(dev)
    for name, fn in shapes.items():
        reps = max(1, int(20 / gemm_ms(fn, 3)))  # ~20 ms of GEMMs
        row = {}
        for blas, carveout in (("cublas", None), ("cublaslt", None), ("cublaslt", programs)):
            torch.backends.cuda.preferred_blas_library(blas)
            torch._C._set_sm_carveout_experimental(carveout)
            label = blas + ("" if carveout is None else f" carveout {carveout}")
            gemm_ms(fn, 3)  # a new setting's first calls choose (and may build) their kernels
            row[f"{label} alone"] = gemm_ms(fn, reps)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # ~40 ms of gathers, longer than the GEMMs beside them
                for _ in range(8):
                    copy_rows(host, rows, staging, None)
            row[f"{label} beside copy"] = gemm_ms(fn, reps)
            torch.cuda.synchronize()
        torch._C._set_sm_carveout_experimental(None)
        torch.backends.cuda.preferred_blas_library("default")
        if dma is not None:
            side.wait_stream(torch.cuda.current_stream())
            for _ in range(8):
                dma(*row_copies(host, host_rows, staging, None), side.cuda_stream)
            row["cublas beside copy-engine gather"] = gemm_ms(fn, reps)
            torch.cuda.synchronize()
        print(f"{name:18s} " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()) + " ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--host-rows", type=int, default=8192)
    ap.add_argument("--row-elems", type=int, default=4 * 128 * 128)
    ap.add_argument("--programs", default=str(dma_module.COPY_PROGRAMS),
                    help="comma-separated program counts of the gather/scatter kernel to time")
    ap.add_argument("--gemm", action="store_true", help="time a 7B layer's GEMMs beside a gather (see above)")
    args = ap.parse_args()
    if args.gemm:
        for programs in map(int, args.programs.split(",")):
            print(f"gather on {programs} programs, carveout {programs} SMs:")
            gemms_beside_copies(programs)
        return
    for programs, dtype in itertools.product(map(int, args.programs.split(",")), (torch.bfloat16, torch.float32)):
        dma_module.COPY_PROGRAMS = programs
        host = torch.randn(args.host_rows, args.row_elems).to(dtype).pin_memory()
        dev = torch.empty(args.rows, args.row_elems, dtype=dtype, device="cuda")
        rows = torch.randperm(args.host_rows)[: args.rows].cuda()
        n_bytes = dev.numel() * dev.element_size()
        gather = gbps(lambda: copy_rows(host, rows, dev, None), n_bytes)
        assert torch.equal(dev.cpu(), host[rows.cpu()])
        scatter = gbps(lambda: copy_rows(dev, None, host, rows), n_bytes)
        contiguous = gbps(lambda: dev.copy_(host[: args.rows], non_blocking=True), n_bytes)
        line = (f"{programs} programs, {dtype}: gather {gather:.1f} GB/s, scatter {scatter:.1f} GB/s, "
                f"contiguous copy_ {contiguous:.1f} GB/s")
        dma, host_rows = batch_copier(), rows.cpu().numpy()
        if dma is not None:
            side = torch.cuda.Stream()  # the driver refuses the legacy default stream
            side.wait_stream(torch.cuda.current_stream())
            dev.zero_()
            with torch.cuda.stream(side):
                engine_gather = gbps(lambda: dma(*row_copies(host, host_rows, dev, None), side.cuda_stream), n_bytes)
                assert torch.equal(dev.cpu(), host[rows.cpu()])
                engine_scatter = gbps(lambda: dma(*row_copies(dev, None, host, host_rows), side.cuda_stream), n_bytes)
            line += f"; copy engines: gather {engine_gather:.1f} GB/s, scatter {engine_scatter:.1f} GB/s"
        print(line)


if __name__ == "__main__":
    main()
