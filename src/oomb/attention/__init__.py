"""Paged attention: a chunk's queries over earlier pages plus its own keys (causal).

Two backends with one signature, `(q, k, v, pages, scale) -> o`:
  - "torch":  reference.py, plain PyTorch (CPU and CUDA; the oracle in tests);
  - "triton": paged.py, kernels that read pages in place and accumulate dK/dV into them.
"""
from __future__ import annotations

import torch

from ..memory.store import LayerPages
from .reference import paged_attention_torch

BACKENDS = ("torch", "triton", "auto")


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}; 'auto' picks triton on CUDA, torch elsewhere")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: LayerPages,
                    scale: float, backend: str) -> torch.Tensor:
    """q: (B, H, C, D); k, v: (B, Hkv, C, D) of the chunk itself -> o: (B, H, C, D)."""
    if backend == "triton":
        from .paged import paged_attention_triton

        return paged_attention_triton(q, k, v, pages, scale)
    return paged_attention_torch(q, k, v, pages, scale)
