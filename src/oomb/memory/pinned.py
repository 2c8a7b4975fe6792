"""Pinned host memory of exactly the requested size, pinned several threads at a time.

torch's pinned allocator (`torch.empty(..., pin_memory=True)`) pins with cudaHostAlloc, which
faults the pages in on one thread, and rounds every block up to a power of two. On the H200
machine (bench/bench_pin.py, 2026-11-30, f800f98): 16 GiB in 7.3 s (2.3 GB/s), and a 1.5 GiB block takes
2 GiB. Here the memory is an ordinary page-aligned allocation whose pages several threads touch
at once, then registered with cudaHostRegister: 16 GiB in 1.33 s (0.71 s touching on 16 threads,
0.62 s registering), exactly the bytes asked for. The registration ends when the memory is freed,
after the last tensor viewing it is gone (a finalizer on the numpy array that owns it: numpy clears
an array's weak references before it frees the data).
"""
from __future__ import annotations

import math
import os
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

PAGE_BYTES = 4096
_TOUCH_SLICE = 256 * 2**20  # bytes one thread zeroes at a time
_MAX_THREADS = 16


def empty_pinned(shape: tuple[int, ...], dtype: torch.dtype, pin: bool = True, local_ranks: int = 1) -> torch.Tensor:
    """A zeroed CPU tensor, pinned (page-locked and mapped for the GPU) when `pin`; pinned by
    torch's own allocator if this system cannot register host memory. local_ranks: processes of
    this machine pinning at once (they share its CPUs)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not pin or nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = np.empty(nbytes + PAGE_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE_BYTES
    buf = raw[start : start + nbytes]
    _touch(buf, touch_threads(local_ranks))
    cudart = torch.cuda.cudart()
    ptr = buf.ctypes.data
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        warnings.warn(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed ({err}); pinning with "
                      "torch's allocator instead (slower, rounded up to a power of two)", stacklevel=2)
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    done = weakref.finalize(raw, _unregister, cudart, ptr)
    done.atexit = False  # the process's end frees it all
    return torch.from_numpy(buf).view(dtype).view(shape)


def _touch(buf: np.ndarray, threads: int) -> None:
    """Fault the pages in on up to `threads` threads (numpy's fill releases the GIL)."""
    slices = [buf[i : i + _TOUCH_SLICE] for i in range(0, buf.size, _TOUCH_SLICE)]
    threads = min(len(slices), threads)
    if threads <= 1:
        buf.fill(0)
        return
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda s: s.fill(0), slices))


def touch_threads(local_ranks: int = 1) -> int:
    """This process's share of the CPUs it may run on (torchrun starts `local_ranks` processes
    per machine), at most 16."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(_MAX_THREADS, cpus // max(1, local_ranks)))


def _unregister(cudart, ptr: int) -> None:
    # Runs as the memory is freed: nothing may still read it. The arenas are dropped between
    # steps, with copies possibly still queued: wait for them first.
    torch.cuda.synchronize()
    cudart.cudaHostUnregister(ptr)


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux): what can be allocated without swapping."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2**62  # unknown: do not refuse
