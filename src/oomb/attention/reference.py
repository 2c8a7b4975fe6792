"""Paged attention in plain PyTorch: the oracle for the Triton kernels and the CPU backend.

A chunk's queries attend to every key of the earlier pages and, causally, to the chunk's own
keys. The earlier pages are gathered into contiguous tensors, attention is ordinary autograd
math in fp32, and the gradient that reaches the gathered keys and values is added into the
fp32 gradient pages (a hook on the gathered leaf), never handed to autograd's graph.
"""
from __future__ import annotations

import torch

from ..memory.store import LayerPages, from_pages, to_pages


def gather_pages(pages: LayerPages) -> tuple[torch.Tensor, torch.Tensor]:
    """Earlier keys and values as contiguous (B, Hkv, n_pages * P, D) tensors."""
    slots = pages.table.long()  # (B, n)
    return from_pages(pages.k[slots]), from_pages(pages.v[slots])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_prev: int, scale: float):
    """Causal GQA attention of a chunk's queries over n_prev earlier keys + its own, in fp32.

    q: (B, H, C, D); k, v: (B, Hkv, n_prev + C, D). Query i sees keys j < n_prev + i + 1.
    Returns o (B, H, C, D) in q's dtype and lse (B, H, C) fp32 (natural log).
    """
    b, h, c, d = q.shape
    n_kv, n = k.shape[1], k.shape[2]
    group = h // n_kv
    # Heads kv*group .. kv*group+group-1 share KV head kv (transformers' repeat_kv order).
    qg = q.float().reshape(b, n_kv, group * c, d)  # (B, Hkv, G*C, D)
    s = torch.matmul(qg, k.float().transpose(-1, -2)) * scale  # (B, Hkv, G*C, N)
    qpos = torch.arange(c, device=q.device).repeat(group) + n_prev  # (G*C,)
    visible = torch.arange(n, device=q.device)[None, :] <= qpos[:, None]  # (G*C, N)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    o = torch.matmul(torch.exp(s - lse), v.float())  # (B, Hkv, G*C, D)
    return o.reshape(b, h, c, d).to(q.dtype), lse.reshape(b, h, c)


def reference_forward(q, k, v, pages: LayerPages, scale: float):
    """(o, lse) of paged attention without autograd: what a kernel's forward must return."""
    kp, vp = gather_pages(pages)
    return attend(q, torch.cat([kp, k], dim=2), torch.cat([vp, v], dim=2), kp.shape[2], scale)


def paged_attention_torch(q, k, v, pages: LayerPages, scale: float) -> torch.Tensor:
    """Torch backend: o (B, H, C, D). With grad enabled and gradient pages given, the
    gradient of the earlier keys/values is added into pages.dk / pages.dv during backward."""
    kp, vp = gather_pages(pages)  # (B, Hkv, n*P, D)
    if torch.is_grad_enabled() and pages.dk is not None and pages.n_pages > 0:
        kp.requires_grad_(True)
        vp.requires_grad_(True)
        slots = pages.table.long()
        kp.register_hook(lambda g: _accumulate(pages.dk, slots, g))
        vp.register_hook(lambda g: _accumulate(pages.dv, slots, g))
    o, _ = attend(q, torch.cat([kp, k], dim=2), torch.cat([vp, v], dim=2), kp.shape[2], scale)
    return o


def _accumulate(dst: torch.Tensor, slots: torch.Tensor, grad: torch.Tensor) -> None:
    # Slots are unique, so a gather-add-scatter is exact and deterministic (no atomics).
    n_pages = slots.shape[1]
    dst[slots] = dst[slots] + to_pages(grad, n_pages).to(dst.dtype)

