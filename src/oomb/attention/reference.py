"""Paged attention in plain PyTorch: the oracle for the Triton kernels and the CPU backend's fused
path (cpu_flash.py), and that backend for what its fused op cannot express.

A chunk's queries attend to every key of a group of earlier pages and (for the first group)
causally to the chunk's own keys. The pages are gathered into contiguous tensors, the math is
written out in fp32 (forward and backward, so it documents what the kernels compute), and the
gradient of the gathered keys and values is added into the gradient pages: no KV tensor ever
enters autograd's graph. Same interface as paged.py: forward() and backward().
"""
from __future__ import annotations

import torch

from ..memory.spec import LayerPages
from ..memory.store import from_pages, to_pages
from .sparse import selection_mask


def gather_pages(pages: LayerPages) -> tuple[torch.Tensor, torch.Tensor]:
    """Earlier keys and values as contiguous (B, Hkv, n_pages * P, D) tensors."""
    slots = pages.table.long()  # (B, n)
    return from_pages(pages.k[slots]), from_pages(pages.v[slots])


def _keys(k, v, pages: LayerPages, include_self: bool):
    """Keys/values a group attends to: its pages, then (causally) the chunk's own."""
    kp, vp = gather_pages(pages)  # (B, Hkv, n*P, D)
    if include_self:
        return torch.cat([kp, k], dim=2), torch.cat([vp, v], dim=2), kp.shape[2]
    return kp, vp, None


def _scores(q, keys, n_prev, scale, pages: LayerPages):
    """fp32 scores (B, Hkv, G*C, N) with the causal mask applied to the chunk's own keys and,
    for sparse attention, the pages a query's block did not select masked out."""
    b, h, c, d = q.shape
    n_kv, n = keys.shape[1], keys.shape[2]
    qg = q.float().reshape(b, n_kv, (h // n_kv) * c, d)  # (B, Hkv, G*C, D)
    s = torch.matmul(qg, keys.float().transpose(-1, -2)) * scale
    if pages.selection is not None and pages.n_pages > 0:
        visible = selection_mask(pages, c).repeat(1, 1, h // n_kv, 1)  # (B, Hkv, G*C, n*P)
        n_paged = visible.shape[-1]
        s[..., :n_paged] = s[..., :n_paged].masked_fill(~visible, float("-inf"))
    n_paged = pages.n_pages * pages.k.shape[2]
    if n_prev is not None:
        qpos = torch.arange(c, device=q.device).repeat(h // n_kv) + n_prev  # (G*C,)
        s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > qpos[:, None], float("-inf"))
    if pages.window:
        # Absolute positions: the group's pages, then (with the chunk) the chunk's own keys.
        kpos = torch.arange(n_paged, device=q.device) + pages.first_page * pages.k.shape[2]
        if n_prev is not None:
            kpos = torch.cat([kpos, torch.arange(c, device=q.device) + pages.q_start])
        qpos = torch.arange(c, device=q.device).repeat(h // n_kv) + pages.q_start  # (G*C,)
        s = s.masked_fill(kpos[None, :] <= qpos[:, None] - pages.window, float("-inf"))
    if pages.key_start is not None:
        s = s.masked_fill(~document_mask(pages, b, c, h // n_kv, n_prev is not None), float("-inf"))
    return s


def document_mask(pages: LayerPages, b: int, c: int, group: int, include_self: bool) -> torch.Tensor:
    """(B, 1, G*C, N) bool: which keys of a group (its pages, then with include_self the chunk's
    own) each query may see by document: key j only by queries whose document starts at or
    before j (attention/documents.py). The causal mask is _scores'."""
    page_size = pages.k.shape[2]
    device = pages.key_start.device
    offsets = torch.arange(page_size, device=device)
    if pages.logical is not None:  # gathered columns: (B, n) logical pages
        kpos = (pages.logical.long()[:, :, None] * page_size + offsets).reshape(b, -1)
    else:
        first = pages.first_page * page_size
        kpos = torch.arange(first, first + pages.n_pages * page_size, device=device).expand(b, -1)
    if include_self:
        kpos = torch.cat([kpos, torch.arange(pages.q_start, pages.q_start + c, device=device).expand(b, -1)], dim=1)
    starts = pages.key_start[:, pages.q_start : pages.q_start + c].long().repeat(1, group)  # (B, G*C)
    return (kpos[:, None, :] >= starts[:, :, None])[:, None]


def forward(q, k, v, pages: LayerPages, scale: float, include_self: bool = True):
    """One group's part of paged attention: (o fp32 (B, H, C, D), lse fp32 (B, H, C), natural log).

    The group is `pages` (all attended by every query) plus, with include_self, the chunk's own
    keys k, v (B, Hkv, C, D) under the causal mask. Groups combine by their LSEs.
    """
    b, h, c, d = q.shape
    keys, values, n_prev = _keys(k, v, pages, include_self)
    s = _scores(q, keys, n_prev, scale, pages)  # (B, Hkv, G*C, N)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    # A sparse group may leave a query nothing to see: its lse is -inf and its o must be 0.
    o = torch.matmul(torch.exp(s - lse.nan_to_num(neginf=0.0)), values.float())
    return o.reshape(b, h, c, d), lse.reshape(b, h, c)


def backward(do, q, k, v, o, lse, pages: LayerPages, scale: float, include_self: bool = True):
    """One group's part of the attention gradient, given the final o and lse of all groups.

        p  = exp(s - lse)                     (s = scale * q k^T, masked)
        dv = p^T do        dp = do v^T        ds = p * (dp - delta),  delta = rowsum(o * do)
        dq = scale * ds k  dk = scale * ds^T q
    Returns (dq fp32 (B, H, C, D), dk, dv of the chunk's own keys in k's dtype or None without
    include_self); the pages' dK/dV are added into pages.dk / pages.dv.
    """
    b, h, c, d = q.shape
    n_kv = k.shape[1]
    keys, values, n_prev = _keys(k, v, pages, include_self)
    s = _scores(q, keys, n_prev, scale, pages)  # (B, Hkv, G*C, N)
    p = torch.exp(s - lse.reshape(b, n_kv, -1, 1))
    dog = do.float().reshape(b, n_kv, -1, d)  # (B, Hkv, G*C, D)
    delta = (o.float().reshape(b, n_kv, -1, d) * dog).sum(-1, keepdim=True)
    dv_all = torch.matmul(p.transpose(-1, -2), dog)  # (B, Hkv, N, D)
    ds = p * (torch.matmul(dog, values.float().transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, keys.float()).reshape(b, h, c, d) * scale
    dk_all = torch.matmul(ds.transpose(-1, -2), q.float().reshape(b, n_kv, -1, d)) * scale
    n_paged = pages.n_pages * pages.k.shape[2]
    if pages.dk is not None and pages.n_pages > 0:
        accumulate_pages(pages.dk, pages.table.long(), dk_all[:, :, :n_paged])
        accumulate_pages(pages.dv, pages.table.long(), dv_all[:, :, :n_paged])
    if not include_self:
        return dq, None, None
    return dq, dk_all[:, :, n_paged:].to(k.dtype), dv_all[:, :, n_paged:].to(v.dtype)


def accumulate_pages(dst: torch.Tensor, slots: torch.Tensor, grad: torch.Tensor) -> None:
    # Slots are unique, so a gather-add-scatter is exact and deterministic (no atomics).
    n_pages = slots.shape[1]
    dst[slots] = dst[slots] + to_pages(grad, n_pages).to(dst.dtype)

