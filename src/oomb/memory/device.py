"""A CUDA device's memory as this process may use it: the driver's free memory and what PyTorch's
caching allocator holds unused, within `torch.cuda.set_per_process_memory_fraction`'s cap (which
the driver does not know of: a process capped to 24 GiB of an H200 is planned as on a 24 GiB GPU)."""
from __future__ import annotations

import torch

#: PyTorch's CUDA allocator settings `oomb train` (and the benchmarks' oomb runs) use unless
#: PYTORCH_CUDA_ALLOC_CONF is set. A step's buffers change size from pass to pass (a chunk's
#: activations, a recomputed layer's gradients, a slice of logits, staged pages), and fixed
#: segments leave them holes: a LoRA step capped to 24 GiB ran out with 0.81 GiB of the cap held
#: by the allocator but unused (H200, 2026-12-03, 553a0ae). Expandable segments map pages into one
#: growing range instead.
ALLOCATOR_SETTINGS = "expandable_segments:True"


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, capacity) bytes of `device` for this process: what it may still allocate, and what
    it may hold in all (the device's memory times its memory fraction)."""
    if device.index is None:  # 'cuda': the current device (memory fractions are set per index)
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(device)
    capacity = int(total * fraction)
    return max(0, min(free + reserved - allocated, capacity - allocated)), capacity
