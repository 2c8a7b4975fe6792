"""The tensors behind the pages: a pool of page slots on the model's device, and host pages.

Device pool (one slot = one page of one layer of one sequence):
    k, v    (n_slots, n_kv_heads, page_size, head_dim)  model dtype
    dk, dv  (n_slots, n_kv_heads, page_size, head_dim)  grad dtype (fp32), zeroed when allocated
                                                        (none for an evaluation-only engine)
    table   (n_device_layers, batch, max_pages) int32 on the device: logical page -> slot
Layers placed on the host keep their pages in offload.HostPages instead; which layers go
where is decided per step from the offload mode and the device budget (`place()`).
Sliding-window layers keep only the last pages of each chunk that a later window can reach
(`tail_pages`): the others are never stored, and these layers never go to the host.

Pages are allocated a chunk at a time for all layers at once, so the table is committed to
the device once per chunk (one small copy), and every per-layer operation is one indexed
tensor op over all the chunk's pages: no Python loop over pages.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .offload import HostPages
from .pool import PagePool
from .spec import KVShape, LayerPages, ScheduledGroups, Selection


class PagedKVStore:
    def __init__(self, shape: KVShape, device: torch.device, sparse=None, copy_engines: bool = True,
                 local_world_size: int = 1) -> None:
        """shape: the model's K/V memory (its pages, which layers are windowed and what they keep,
        the representatives' size, the pages a host layer stages). sparse: the SparsePolicy
        (attention/policy.py) whose page representatives the store makes (the one `shape` was
        built with), or None (dense)."""
        self.shape = shape
        self.spec = spec = shape.page
        self.tail_pages = shape.tail_pages  # sliding-window layer -> pages kept per chunk
        # Sparse attention: a representative per page and KV head (a few KiB a page), logically
        # indexed, (device layers, B, max_pages, Hkv, R, D); host layers keep theirs on the host.
        self.sparse = sparse
        self.rep_size = shape.rep_size
        self.reps = None
        self.n_layers = n_layers = shape.n_layers
        self.device = torch.device(device)
        self.pool = PagePool(0, spec.page_bytes)
        self.k = torch.empty((0, spec.n_kv_heads, spec.page_size, spec.head_dim), dtype=spec.dtype,
                             device=self.device)
        self.v = torch.empty_like(self.k)
        self.dk = self.dv = None  # gradient pools (None without gradient pages)
        self.table = torch.empty((n_layers, 0, 0), dtype=torch.int32, device=self.device)
        # how host pages are pinned and moved (config.KernelOptions.copy_engines, EngineConfig.local_world_size)
        self._host_options = dict(copy_engines=copy_engines, local_ranks=local_world_size)
        self.host = HostPages(shape, [], self.device, **self._host_options)
        self._row = {layer: layer for layer in range(n_layers)}  # device layer -> table row
        self._rep_row = self._rep_rows()  # full device layer -> row of self.reps
        self._chunk_slots: dict[int, list[int]] = {}

    # -- placement and capacity -------------------------------------------------------------

    def place(self, host_layers: list[int]) -> None:
        """Keep the pages of `host_layers` on the host, the others in the device pool."""
        host_layers = sorted(layer for layer in host_layers if layer not in self.tail_pages)
        # A step that needs fewer host layers (a shorter one) keeps the arena pinned for the
        # longer ones: pinning costs ~0.5 s per GiB, the unused pinned pages cost nothing on the GPU.
        if not set(host_layers) <= set(self.host.layers):
            self.host = HostPages(self.shape, host_layers, self.device, **self._host_options)
        device_layers = [layer for layer in range(self.n_layers) if layer not in set(host_layers)]
        self._row = {layer: i for i, layer in enumerate(device_layers)}
        self._rep_row = self._rep_rows()

    def _rep_rows(self) -> dict[int, int]:
        """Rows of the device representatives: full-attention device layers only (sliding-window
        layers attend densely, host layers keep theirs on the host)."""
        return {layer: i for i, layer in enumerate(x for x in self._row if x not in self.tail_pages)}

    def begin_step(self, batch: int, max_pages: int) -> None:
        """Make room for `max_pages` pages per layer and sequence; the store must be empty."""
        assert not self._chunk_slots, "begin_step() with pages still held from the last step"
        need = self.device_pages(batch, max_pages)
        if need > self.pool.n_slots:
            # Grow once to the step's need; the buffers are empty, so nothing is copied.
            shape = (need, self.spec.n_kv_heads, self.spec.page_size, self.spec.head_dim)
            self.k = self.v = self.dk = self.dv = None  # free the old buffers first
            self.k = torch.empty(shape, dtype=self.spec.dtype, device=self.device)
            self.v = torch.empty_like(self.k)
            if self.spec.grads:
                self.dk = torch.empty(shape, dtype=self.spec.grad_dtype, device=self.device)
                self.dv = torch.empty_like(self.dk)
            self.pool.grow(need)
        if self.table.shape != (len(self._row), batch, max_pages):
            self.table = torch.full((len(self._row), batch, max_pages), -1, dtype=torch.int32, device=self.device)
        self.host.begin_step(batch, max_pages)
        if self.rep_size:
            shape = (len(self._rep_row), batch, max_pages, self.spec.n_kv_heads, self.rep_size, self.spec.head_dim)
            if self.reps is None or self.reps.shape[:2] != shape[:2] or self.reps.shape[2] < max_pages:
                self.reps = None
                self.reps = torch.empty(shape, dtype=self.spec.dtype, device=self.device)

    @property
    def host_layers(self) -> list[int]:
        """Layers whose pages live on the host (placed by the last `place()`)."""
        return [layer for layer in range(self.n_layers) if layer not in self._row]

    @property
    def layer_page_bytes(self) -> int:
        """Bytes of one page of one full-attention layer: K, V, dK, dV and the sparse representatives."""
        return self.shape.layer_page_bytes

    def device_pages(self, batch: int, max_pages: int) -> int:
        """Pool slots a step needs: full layers keep every page, windowed ones their tails."""
        if not self.tail_pages:
            return len(self._row) * batch * max_pages
        chunk_pages = self.shape.chunk_pages
        n_chunks = max_pages // chunk_pages
        return sum(batch * n_chunks * self.shape.kept_pages(layer, chunk_pages) for layer in self._row)

    def device_bytes(self, batch: int, max_pages: int) -> int:
        """Device bytes of the pool for a step, plus the host layers' staging buffers."""
        reps = len(self._rep_row) * batch * max_pages * self.shape.rep_bytes
        return self.device_pages(batch, max_pages) * self.spec.page_bytes + reps + self.host.staging_bytes(batch, max_pages)

    # -- per chunk ------------------------------------------------------------------------

    def alloc_chunk(self, chunk: int, first_page: int, n_pages: int) -> None:
        """Allocate pages [first_page, first_page + n_pages) of every device layer and sequence."""
        rows, batch = self.table.shape[:2]
        counts = [self.shape.kept_pages(layer, n_pages) for layer in self._row]
        ids = self.pool.alloc(batch * sum(counts))
        self._chunk_slots[chunk] = ids
        slots = torch.full((rows, batch, n_pages), -1, dtype=torch.int32)
        offset = 0
        for row, kept in enumerate(counts):  # a windowed layer stores the chunk's last pages
            slots[row, :, n_pages - kept :] = torch.tensor(ids[offset : offset + batch * kept]).view(batch, kept)
            offset += batch * kept
        self.table[:, :, first_page : first_page + n_pages].copy_(slots, non_blocking=True)

    def free_chunk(self, chunk: int) -> None:
        """Return a chunk's pages (its backward is done: nothing reads them again)."""
        self.pool.free(self._chunk_slots.pop(chunk))

    def free_all(self) -> None:
        for chunk in list(self._chunk_slots):
            self.free_chunk(chunk)

    # -- per layer ------------------------------------------------------------------------

    def write(self, layer: int, first_page: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a chunk's post-RoPE keys and values (and zero their gradient pages).

        k, v: (B, Hkv, n_pages * P, D), the chunk's tokens starting at page `first_page`.
        """
        assert k.shape[2] % self.spec.page_size == 0, "only whole pages are stored"
        n_pages = k.shape[2] // self.spec.page_size
        if layer not in self._row:
            if self.rep_size:
                self.host.write_reps(layer, first_page, self.sparse.representatives(k, n_pages))
            return self.host.write(layer, first_page, k, v)
        if self.rep_size and layer not in self.tail_pages:  # sliding-window layers attend densely
            reps = self.sparse.representatives(k, n_pages)
            self.reps[self._rep_row[layer], :, first_page : first_page + n_pages] = reps
        skip = n_pages - self.shape.kept_pages(layer, n_pages)  # a windowed layer's pages no window reaches
        k, v = k[:, :, skip * self.spec.page_size :], v[:, :, skip * self.spec.page_size :]
        first_page, n_pages = first_page + skip, n_pages - skip
        slots = self.table[self._row[layer], :, first_page : first_page + n_pages].long()  # (B, n)
        self.k[slots] = to_pages(k, n_pages)
        self.v[slots] = to_pages(v, n_pages)
        if self.spec.grads:  # index_fill_, not `dk[slots] = 0`: that copies the 0 from the host and syncs
            self.dk.index_fill_(0, slots.flatten(), 0)
            self.dv.index_fill_(0, slots.flatten(), 0)

    def page_groups(self, layer: int, n_pages: int, window: int = 0, first_page: int = 0,
                    docs=None) -> ScheduledGroups:
        """The first `n_pages` pages of `layer` (the chunks before the current one), as a
        callable that yields them `group_pages` at a time (see attention/function.py); with a
        `window`, only the pages a sliding window starting at the chunk can reach; from
        `first_page` on only (packed documents: the pages before hold documents no query of the
        chunk sees, which are never read). docs: the step's packed documents
        (attention/documents.Documents), which attention masks by, or None."""
        q_start = n_pages * self.spec.page_size
        first = max(0, (q_start - window + 1) // self.spec.page_size) if window else 0
        first = max(first, first_page)
        extra = {"window": window, "q_start": q_start, **_document_fields(docs)}
        if layer not in self._row:
            return self.host.page_groups(layer, first, n_pages, extra)
        # shape.staged_pages: the dense layers of a sparse model group as their host copies must (a
        # selection's worth), so every offload mode reads them alike (bitwise-equal gradients).
        return _PoolGroups(self, self.table[self._row[layer], :, :n_pages], first, extra, self.shape.staged_pages)

    def selected_groups(self, layer: int, n_pages: int, selection: Selection, block_queries: int,
                        copy_engines: bool = False, docs=None) -> ScheduledGroups:
        """The pages a sparse selection reads of the first `n_pages` pages of `layer`, as one
        group: its pages are the chunk's candidates, its per-block picks index them. A host
        layer's move on the copy engines with `copy_engines` (its host copy is done, or nearly:
        the host waits for it), else by the zero-copy kernel. docs: as page_groups'."""
        extra = {"selection": selection.blocks, "block_queries": block_queries,
                 "q_start": n_pages * self.spec.page_size, **_document_fields(docs)}
        if docs is not None:  # the keys' positions, for the documents' mask
            extra["logical"] = selection.pages
        if layer not in self._row:
            return self.host.page_groups(layer, 0, n_pages, extra, selection.pages,
                                         selection.host_pages if copy_engines else None)
        table = self.table[self._row[layer], :, :n_pages].gather(1, selection.pages.long())
        return _PoolGroups(self, table, 0, extra, max(1, table.shape[1]))

    def copy_to_host(self, layer: int, selection: Selection) -> Selection:
        """A host layer's selection with a copy of its pages on the way to the host (when the copy
        engines are there to use it: memory/dma.py); others as they are."""
        if layer in self._row or self.host.dma is None:
            return selection
        return selection._replace(host_pages=self.host.copy_rows_to_host(selection.pages))

    def representatives(self, layer: int, n_pages: int) -> torch.Tensor:
        """(B, n_pages, Hkv, R, D) of the first n_pages pages of `layer` (sparse attention; R = 0,
        an empty tensor, for a policy that keeps none)."""
        if not self.rep_size:
            s = self.spec
            return torch.empty((self.table.shape[1], n_pages, s.n_kv_heads, 0, s.head_dim), dtype=s.dtype,
                               device=self.device)
        if layer not in self._row:
            return self.host.representatives(layer, n_pages)
        return self.reps[self._rep_row[layer], :, :n_pages]

    def earlier_keys(self, layer: int, n_pages: int) -> torch.Tensor:
        """(B, Hkv, n_pages * P, D): a copy, on the device, of the keys of the first n_pages pages of
        a full-attention layer (diagnostics that need every key, e.g. selection recall)."""
        if layer not in self._row:
            return self.host.earlier_keys(layer, n_pages)
        return from_pages(self.k[self.table[self._row[layer], :, :n_pages].long()])

    def chunk_grads(self, layer: int, first_page: int, n_pages: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """The function that gives the dK, dV later chunks accumulated for a chunk's own keys,
        (B, Hkv, n*P, D): a host layer's are copied from now on, a device layer's are read when
        it is called."""
        if layer not in self._row:
            return self.host.chunk_grads(layer, first_page, n_pages)

        def ready() -> tuple[torch.Tensor, torch.Tensor]:
            kept = self.shape.kept_pages(layer, n_pages)
            slots = self.table[self._row[layer], :, first_page + n_pages - kept : first_page + n_pages].long()
            dk, dv = from_pages(self.dk[slots]), from_pages(self.dv[slots])
            if kept < n_pages:  # pages never stored received no gradient
                pad = (0, 0, (n_pages - kept) * self.spec.page_size, 0)
                dk, dv = torch.nn.functional.pad(dk, pad), torch.nn.functional.pad(dv, pad)
            return dk, dv

        return ready


class _PoolGroups:
    """A device layer's earlier pages, `group_pages` at a time, read in place from the pool
    (a ScheduledGroups)."""

    def __init__(self, store: PagedKVStore, table: torch.Tensor, first: int, extra: dict, group_pages: int) -> None:
        self.store, self.table, self.first, self.extra = store, table, first, extra  # table (B, n_pages)
        self.group_pages = group_pages

    def prefetch(self, with_grad: bool) -> None:
        pass  # already on the device

    def then(self, with_grad: bool, groups: ScheduledGroups) -> None:
        groups.prefetch(with_grad)  # this layer needs no staging buffer: the next one's can load now

    def __call__(self, with_grad: bool):
        s, n_pages = self.store, self.table.shape[1]
        dk, dv = (s.dk, s.dv) if with_grad else (None, None)
        for start in range(self.first, max(n_pages, self.first + 1), self.group_pages):
            yield LayerPages(s.k, s.v, dk, dv, self.table[:, start : start + self.group_pages], start, **self.extra)


def _document_fields(docs) -> dict:
    """LayerPages' packed-document fields of a step's Documents (or None: none)."""
    return {} if docs is None else {"key_start": docs.key_start, "doc_end": docs.doc_end}


def to_pages(x: torch.Tensor, n_pages: int) -> torch.Tensor:
    b, h, t, d = x.shape
    return x.reshape(b, h, n_pages, t // n_pages, d).transpose(1, 2)  # (B, n, Hkv, P, D)


def from_pages(x: torch.Tensor) -> torch.Tensor:
    b, n, h, p, d = x.shape
    return x.transpose(1, 2).reshape(b, h, n * p, d)  # (B, Hkv, n*P, D)
