"""Per-step progress: loss, tokens/s and memory, one line per logged step."""
from __future__ import annotations

import resource
import sys
import time

import torch


def peak_memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated (CUDA) or the process's peak resident set (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class StepLogger:
    def __init__(self, total_steps: int, device: torch.device, stream=sys.stdout) -> None:
        self.total_steps = total_steps
        self.device = device
        self.stream = stream
        self.start = time.perf_counter()

    def log(self, step: int, loss: float, tokens: int, seconds: float, lr: float, grad_norm: float) -> None:
        elapsed = time.perf_counter() - self.start
        eta = elapsed / step * (self.total_steps - step) if step else 0.0
        print(f"step {step:>5}/{self.total_steps}  loss {loss:.4f}  {tokens / seconds:,.0f} tok/s  "
              f"lr {lr:.2e}  grad_norm {grad_norm:.3f}  mem {peak_memory_gib(self.device):.2f} GiB  "
              f"elapsed {elapsed:.0f}s  eta {eta:.0f}s", file=self.stream, flush=True)
