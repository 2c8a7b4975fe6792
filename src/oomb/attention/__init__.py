"""Paged attention: a chunk's queries over earlier pages plus its own keys (causal).

Two backends with one pair of functions, `forward(q, k, v, pages, scale, include_self)` and
`backward(do, q, k, v, o, lse, pages, scale, include_self)`:
  - "torch":  cpu_flash.py, PyTorch's fused CPU flash attention, and for what it cannot
              express (sparse, sliding windows, CUDA tensors) reference.py, plain PyTorch with
              every score materialised: the oracle in tests;
  - "triton": paged.py, kernels that read pages in place and accumulate dK/dV into them.
function.py runs either over the groups of a layer's pages, with autograd. `Backend` is one of
them with the kernel options it runs with (oomb.KernelOptions).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from .function import PagedAttention, PageGroups, attention_forward
from .options import KernelOptions

BACKENDS = ("torch", "triton", "auto")
_MODULES = {"torch": "oomb.attention.cpu_flash", "triton": "oomb.attention.paged"}


@dataclass(frozen=True)
class Backend:
    """A backend's `forward` / `backward` (function.py's ops), run with `kernels` (an
    oomb.KernelOptions, or None: every fast path on) on `device` (None: not said; only str() looks)."""

    name: str
    kernels: KernelOptions | None = None
    device: torch.device | None = None

    def __post_init__(self) -> None:
        if self.name not in _MODULES:
            raise ValueError(f"backend={self.name!r} is not one of {tuple(_MODULES)}")

    @property
    def _ops(self):
        return importlib.import_module(_MODULES[self.name])

    def forward(self, q, k, v, pages, scale: float, include_self: bool = True):
        return self._ops.forward(q, k, v, pages, scale, include_self, kernels=self.kernels)

    def backward(self, do, q, k, v, o, lse, pages, scale: float, include_self: bool = True):
        return self._ops.backward(do, q, k, v, o, lse, pages, scale, include_self, kernels=self.kernels)

    def __str__(self) -> str:
        """'triton, kernels: hopper-fused' where dense pages' backward can take paged_hopper's fused
        Gluon kernel (a Hopper GPU, a Triton with the Gluon features it uses, KernelOptions.gluon on;
        per call, paged_hopper.eligible decides), 'triton, kernels: triton' where it cannot."""
        if self.name != "triton":
            return self.name
        from . import paged_hopper  # imports triton: only for the triton backend
        fused = (self.kernels is None or self.kernels.gluon) and self.device is not None and \
            paged_hopper.runs_on(self.device)
        return f"{self.name}, kernels: {'hopper-fused' if fused else 'triton'}"


def resolve_backend(backend: str, device: torch.device, kernels: KernelOptions | None = None) -> Backend:
    """The backend `backend` names ('auto': triton on CUDA, torch elsewhere) with `kernels`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}; 'auto' picks triton on CUDA, torch elsewhere")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not _interpreted():
        raise ValueError(f"backend='triton' runs CUDA kernels and this run is on {device}; use backend 'torch' "
                         "(--backend torch, or auto: torch off CUDA)")
    return Backend(backend, kernels, device)


def _interpreted() -> bool:
    """Triton runs its kernels through its interpreter, on CPU tensors (TRITON_INTERPRET=1, as the
    CPU tests set it)."""
    try:
        from triton import knobs
    except ImportError:  # no Triton at all
        return False
    return bool(knobs.runtime.interpret)


def _backend(backend) -> Backend:
    return backend if isinstance(backend, Backend) else Backend(backend)


def single_group(pages) -> PageGroups:
    """All of a layer's earlier pages as one group (tests, benchmarks, small contexts)."""
    return lambda with_grad: iter([pages])


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: PageGroups,
                    scale: float, backend: Backend | str, sinks: torch.Tensor | None = None,
                    known: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q: (B, H, C, D); k, v: (B, Hkv, C, D) of the chunk itself -> o: (B, H, C, D).

    With autograd on, backward adds the earlier pages' dK/dV into their gradient pages.
    sinks: (H,) attention-sink logits (GPT-OSS), or None.
    known: (o, lse) of these same inputs from attention_with_lse (stage 1 of the chunk): the
    forward is not computed again; backward reads the pages as always.
    """
    ops = _backend(backend)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, sinks)):
        return PagedAttention.apply(q, k, v, sinks, groups, scale, ops, known)
    if known is not None:
        return known[0]
    return attention_with_lse(q, k, v, groups, scale, backend, sinks)[0]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: PageGroups, scale: float,
                       backend: Backend | str, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o (B, H, C, D) in q's dtype, lse fp32 (B, H, C)), without autograd: what a later
    paged_attention(..., known=) of the same inputs takes instead of computing them again."""
    o, lse = attention_forward(_backend(backend), q, k, v, groups, scale, sinks)
    return o.to(q.dtype), lse
