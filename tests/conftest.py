import mmap
import os
import sys

import pytest
import torch

# Triton kernels run through the interpreter on CPU tensors; it must be chosen before
# triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`-n N`) the workers share the cores: each takes its share of threads, and so
# do the processes it starts (CLI runs, torchrun), instead of every one of them taking all.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(_threads)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run on the GPU machine with `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class MemmoveCopier:
    """Stands in for memory/dma.py's batched driver copy on CPU: each copy is a memmove; counts
    the calls and copies."""

    def __init__(self):
        self.calls, self.copies = 0, 0

    def __call__(self, dsts, srcs, sizes, stream):
        import ctypes
        self.calls += 1
        self.copies += len(sizes)
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            ctypes.memmove(dst, src, size)


@pytest.fixture
def memmove_copier():
    return MemmoveCopier()


def beyond_int32(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(y, shift): y[shift:] is a copy of x (rows along dim 0) whose every element lies 2**31 or more
    elements past y's start, where an offset computed in int32 overflows; and y starts 2**31
    elements into its memory, so an offset that wrapped to a negative int32 reads zeros there
    rather than faulting. The memory is address space only (mmap with MAP_NORESERVE: 8 to 16 GiB
    of it, of which only the pages written are ever committed); the test skips where the system
    refuses that."""
    row = x[0].numel()
    shift = -(-2**31 // row)
    n = (2 * shift + x.shape[0]) * row
    noreserve = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
    try:
        mem = mmap.mmap(-1, n * x.element_size(), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | noreserve)
    except (OSError, ValueError) as e:
        pytest.skip(f"cannot reserve {n * x.element_size() / 2**30:.0f} GiB of address space: {e}")
    y = torch.frombuffer(mem, dtype=x.dtype)[shift * row :].view(shift + x.shape[0], *x.shape[1:])
    y[shift:] = x
    return y, shift


@pytest.fixture(name="beyond_int32")
def beyond_int32_fixture():
    return beyond_int32
