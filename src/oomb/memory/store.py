"""The tensors behind the pages: one buffer of page slots on the model's device.

Layout (one slot = one page of one layer of one sequence):
    k, v    (n_slots, n_kv_heads, page_size, head_dim)  model dtype
    dk, dv  (n_slots, n_kv_heads, page_size, head_dim)  grad dtype (fp32), zeroed when allocated
    table   (n_layers, batch, max_pages) int32 on the device: logical page -> slot

Pages are allocated a chunk at a time for all layers at once, so the table is committed to
the device once per chunk (one small copy), and every per-layer operation is one indexed
tensor op over all the chunk's pages: no Python loop over pages.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .pool import PagePool
from .spec import PageSpec


class LayerPages(NamedTuple):
    """What attention needs of one layer's earlier pages (all views, no copies)."""

    k: torch.Tensor  # (n_slots, Hkv, P, D)
    v: torch.Tensor  # (n_slots, Hkv, P, D)
    dk: torch.Tensor | None  # (n_slots, Hkv, P, D) fp32, or None when no gradient is wanted
    dv: torch.Tensor | None
    table: torch.Tensor  # (B, n_pages) int32: slots of the earlier pages, in position order

    @property
    def n_pages(self) -> int:
        return self.table.shape[1]


class PagedKVStore:
    def __init__(self, spec: PageSpec, n_layers: int, device: torch.device) -> None:
        self.spec = spec
        self.n_layers = n_layers
        self.device = torch.device(device)
        self.pool = PagePool(0, spec.page_bytes)
        shape = (0, spec.n_kv_heads, spec.page_size, spec.head_dim)
        self.k = torch.empty(shape, dtype=spec.dtype, device=self.device)
        self.v = torch.empty_like(self.k)
        self.dk = torch.empty(shape, dtype=spec.grad_dtype, device=self.device)
        self.dv = torch.empty_like(self.dk)
        self.table = torch.empty((n_layers, 0, 0), dtype=torch.int32, device=self.device)
        self._chunk_slots: dict[int, list[int]] = {}

    # -- capacity -------------------------------------------------------------------------

    def begin_step(self, batch: int, max_pages: int) -> None:
        """Make room for `max_pages` pages per layer and sequence; the store must be empty."""
        assert not self._chunk_slots, "begin_step() with pages still held from the last step"
        need = self.n_layers * batch * max_pages
        if need > self.pool.n_slots:
            # Grow once to the step's need; the buffers are empty, so nothing is copied.
            shape = (need, self.spec.n_kv_heads, self.spec.page_size, self.spec.head_dim)
            self.k = self.v = self.dk = self.dv = None  # free the old buffers first
            self.k = torch.empty(shape, dtype=self.spec.dtype, device=self.device)
            self.v = torch.empty_like(self.k)
            self.dk = torch.empty(shape, dtype=self.spec.grad_dtype, device=self.device)
            self.dv = torch.empty_like(self.dk)
            self.pool.grow(need)
        if self.table.shape[1:] != (batch, max_pages):
            self.table = torch.full((self.n_layers, batch, max_pages), -1, dtype=torch.int32, device=self.device)

    @property
    def allocated_bytes(self) -> int:
        return self.pool.n_slots * self.spec.page_bytes

    # -- per chunk ------------------------------------------------------------------------

    def alloc_chunk(self, chunk: int, first_page: int, n_pages: int) -> None:
        """Allocate pages [first_page, first_page + n_pages) of every layer and sequence."""
        batch = self.table.shape[1]
        ids = self.pool.alloc(self.n_layers * batch * n_pages)
        self._chunk_slots[chunk] = ids
        slots = torch.tensor(ids, dtype=torch.int32).view(self.n_layers, batch, n_pages)
        self.table[:, :, first_page : first_page + n_pages].copy_(slots, non_blocking=True)

    def free_chunk(self, chunk: int) -> None:
        """Return a chunk's pages (its backward is done: nothing reads them again)."""
        self.pool.free(self._chunk_slots.pop(chunk))

    def free_all(self) -> None:
        for chunk in list(self._chunk_slots):
            self.free_chunk(chunk)

    # -- per layer ------------------------------------------------------------------------

    def write(self, layer: int, first_page: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a chunk's post-RoPE keys and values and zero their gradient pages.

        k, v: (B, Hkv, n_pages * P, D), the chunk's tokens starting at page `first_page`.
        """
        batch, n_kv, length, dim = k.shape
        n_pages = length // self.spec.page_size
        assert n_pages * self.spec.page_size == length, "only whole pages are stored"
        slots = self.table[layer, :, first_page : first_page + n_pages].long()  # (B, n)
        # (B, Hkv, n*P, D) -> (B, n, Hkv, P, D): one page per (sequence, logical page)
        self.k[slots] = to_pages(k, n_pages)
        self.v[slots] = to_pages(v, n_pages)
        self.dk[slots] = 0
        self.dv[slots] = 0

    def layer_pages(self, layer: int, n_pages: int, with_grad: bool) -> LayerPages:
        """The first `n_pages` pages of `layer` (the chunks before the current one)."""
        return LayerPages(
            self.k, self.v, self.dk if with_grad else None, self.dv if with_grad else None,
            self.table[layer, :, :n_pages],
        )

    def chunk_grads(self, layer: int, first_page: int, n_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """dK, dV that later chunks accumulated for a chunk's own keys: (B, Hkv, n*P, D) fp32."""
        slots = self.table[layer, :, first_page : first_page + n_pages].long()
        return from_pages(self.dk[slots]), from_pages(self.dv[slots])


def to_pages(x: torch.Tensor, n_pages: int) -> torch.Tensor:
    b, h, t, d = x.shape
    return x.reshape(b, h, n_pages, t // n_pages, d).transpose(1, 2)  # (B, n, Hkv, P, D)


def from_pages(x: torch.Tensor) -> torch.Tensor:
    b, n, h, p, d = x.shape
    return x.transpose(1, 2).reshape(b, h, n * p, d)  # (B, Hkv, n*P, D)
