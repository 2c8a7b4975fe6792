"""Scattered host<->GPU row copies on the copy engines: one driver call per transfer.

A sparse selection's pages lie scattered over a host layer's arena. The zero-copy kernel
(copy_rows, below) gathers them from a row list that lives on the GPU, but each of its programs
holds an SM while it waits on PCIe, and the one-wave GEMMs beside it then need a second wave
(+9 to +61 %, H200, 2026-11-30, faca5b1..8dfc1fc). When the rows are known on the host (stage 2
reads the selections stage 1 made), the copy engines can move them instead: each run of
consecutive rows becomes one copy, and every copy of a transfer goes to the driver in one call,
`cuMemcpyBatchAsync` (CUDA 12.8+), ordered on its stream like `cudaMemcpyAsync`.

The driver is reached through ctypes (libcuda.so.1, which every CUDA system has);
KernelOptions(copy_engines=False) (`OOMB_DMA=0` at the command line),
a driver without the call, or a CPU-only system leave the kernel in charge.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch
import triton
import triton.language as tl

_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: read the source in stream order
_PREFER_OVERLAP_WITH_COMPUTE = 1  # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("src_access_order", ctypes.c_int), ("src_location", _Location),
                ("dst_location", _Location), ("flags", ctypes.c_uint)]


_P = ctypes.c_void_p
_SIZE = ctypes.c_size_t


class BatchCopier:
    """copy(dsts, srcs, sizes, stream): dsts[i] <- srcs[i] (sizes[i] bytes) for every i, queued on
    `stream` (a CUstream handle, e.g. torch.cuda.Stream().cuda_stream; not the legacy default
    stream, which the driver refuses); the arrays are uint64 addresses (unified addressing:
    pinned host or device memory)."""

    def __init__(self, fn, with_fail_index: bool) -> None:
        self._fn = fn
        self._with_fail_index = with_fail_index  # CUDA 12.8/12.9's signature; 13.0's `_v2` dropped it
        self._attrs = _Attributes(_SRC_ACCESS_ORDER_STREAM, _Location(0, 0), _Location(0, 0),
                                  _PREFER_OVERLAP_WITH_COMPUTE)
        self._first = _SIZE(0)  # every copy has the one attribute set, from copy 0 on

    def __call__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        n = len(sizes)
        if n == 0:
            return
        if not stream:
            raise ValueError("cuMemcpyBatchAsync refuses the legacy default stream (handle 0): queue the copies "
                             "on a torch.cuda.Stream() of their own")
        dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
        args = [dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n, ctypes.byref(self._attrs),
                ctypes.byref(self._first), 1]
        fail = _SIZE(0)
        if self._with_fail_index:
            args.append(ctypes.byref(fail))
        err = self._fn(*args, _P(stream))
        if err:
            raise RuntimeError(f"cuMemcpyBatchAsync of {n} copies failed with CUDA driver error {err}"
                               + (f" at copy {fail.value}" if self._with_fail_index else "")
                               + "; set OOMB_DMA=0 (KernelOptions(copy_engines=False)) to move host pages with the "
                               "zero-copy kernel instead")


@functools.cache
def batch_copier() -> BatchCopier | None:
    """The driver's batched copy, or None (no CUDA driver, or one older than 12.8)."""
    if not torch.cuda.is_available():
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name, with_fail_index in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            fn.argtypes = [_P, _P, _P, _SIZE, _P, _P, _SIZE] + ([_P] if with_fail_index else []) + [_P]
            return BatchCopier(fn, with_fail_index)
    return None


def runs(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first position, length) of each maximal run of consecutive values in `rows`."""
    if rows.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(rows) != 1) + 1))
    return starts, np.diff(np.concatenate((starts, [rows.size])))


def row_copies(src: torch.Tensor, src_rows: np.ndarray | None, dst: torch.Tensor,
               dst_rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The copies (dsts, srcs, sizes) of dst[dst_rows[r]] = src[src_rows[r]] for every r (None: r
    itself), one per run of consecutive rows; src and dst contiguous, rows along dim 0."""
    rows = src_rows if src_rows is not None else dst_rows
    assert src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype and rows is not None
    row_bytes = src[0].numel() * src.element_size()
    starts, lengths = runs(rows)
    first = rows[starts].astype(np.uint64)
    src_first = first if src_rows is not None else starts.astype(np.uint64)
    dst_first = first if dst_rows is not None else starts.astype(np.uint64)
    return (np.uint64(dst.data_ptr()) + dst_first * np.uint64(row_bytes),
            np.uint64(src.data_ptr()) + src_first * np.uint64(row_bytes),
            lengths.astype(np.uint64) * np.uint64(row_bytes))


# Programs of a copy: each holds an SM slot while it waits on PCIe, and a compute kernel's block
# (a whole SM's registers) cannot share the SM with it, so every program beyond what fills PCIe
# keeps an SM from the compute a transfer is meant to overlap. 8 programs, each moving 32 KiB per
# load, fill it (bench_copy.py on an H200: gather / scatter 49.4-51.1 / 51.9-52.3 GB/s at 8, 16
# and 32 programs). 1M top-k step with every layer's pages on the host ('all'), 8 vs 32 programs:
# float8 146.8 vs 155.1 s, bf16 169.8 vs 171.9 s (H200, 2026-11-30, 7e531eb).
COPY_PROGRAMS = 8


@triton.jit
def _copy_rows_kernel(Src, SrcRows, Dst, DstRows, n_rows, row_elems, GATHER: tl.constexpr, SCATTER: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Rows pid, pid + programs, ... of the copy."""
    for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        src = tl.zeros([], tl.int64) + r  # 64-bit offsets (the loop index is a plain int under the interpreter)
        dst = src
        if GATHER:  # row lists of any integer type: a host layer's arena passes 2**31 elements (7B, 4M tokens)
            src = tl.load(SrcRows + r).to(tl.int64)
        if SCATTER:
            dst = tl.load(DstRows + r).to(tl.int64)
        for start in range(0, row_elems, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < row_elems
            tl.store(Dst + dst * row_elems + offs, tl.load(Src + src * row_elems + offs, mask=mask), mask=mask)


def copy_rows(src: torch.Tensor, src_rows: torch.Tensor | None, dst: torch.Tensor, dst_rows: torch.Tensor | None) -> None:
    """dst[dst_rows[r]] = src[src_rows[r]] for every r (None: r itself), on the current stream.

    src, dst: contiguous, rows along dim 0; one of them may be pinned host memory when the other
    is on the GPU: the kernel then reads or writes the host directly (zero-copy through unified
    addressing), so a gather of scattered host pages is one launch and needs no host sync.
    On CPU it is plain indexing.
    """
    rows = src_rows if src_rows is not None else dst_rows
    if not (src.is_cuda or dst.is_cuda):
        if src_rows is None:
            dst.index_copy_(0, dst_rows, src[: rows.numel()])
        else:
            dst[: rows.numel()] = src.index_select(0, src_rows)
        return
    assert src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype
    row_elems = src[0].numel()
    n_rows = rows.numel()
    _copy_rows_kernel[(min(n_rows, COPY_PROGRAMS),)](src, src_rows if src_rows is not None else rows, dst,
                                                     dst_rows if dst_rows is not None else rows, n_rows, row_elems,
                                                     GATHER=src_rows is not None, SCATTER=dst_rows is not None,
                                                     BLOCK=min(16384, triton.next_power_of_2(row_elems)), num_warps=4)
