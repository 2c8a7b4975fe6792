"""A CUDA device's memory as this process may use it: the driver's free memory and what PyTorch's
caching allocator holds unused, within `torch.cuda.set_per_process_memory_fraction`'s cap (which
the driver does not know of: a process capped to 24 GiB of an H200 is planned as on a 24 GiB GPU)."""
from __future__ import annotations

import torch


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, capacity) bytes of `device` for this process: what it may still allocate, and what
    it may hold in all (the device's memory times its memory fraction)."""
    free, total = torch.cuda.mem_get_info(device)
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(device)
    capacity = int(total * fraction)
    return max(0, min(free + reserved - allocated, capacity - allocated)), capacity
