import os

import pytest
import torch

# Triton kernels run through the interpreter on CPU tensors; it must be chosen before
# triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
