"""Pages that live on the host, and their trips to the GPU (offload 'all' and 'auto').

Host arena, one block per layer and buffer, allocated once (pinned on CUDA, by memory/pinned.py:
~12 GB/s, done once and reused across steps), page-major so that a chunk's pages
and a group's pages are each one contiguous range:
    k, v    (max_pages, B, Hkv, P, D)  model dtype
    dk, dv  (max_pages, B, Hkv, P, D)  grad dtype
    reps    (max_pages, B, Hkv, R, D)  model dtype, sparse attention's page representatives
(a HostLayer each: dk, dv only with gradient pages, reps only with sparse attention)
GPU staging, two buffers (Staged, double buffering) of `group_pages` pages (a layer's pages, when fewer):
    k, v, dk, dv  (group_pages * B, Hkv, P, D);  staged page j of sequence b is slot j*B + b

Ordering is by CUDA events on two copy streams (host->GPU and GPU->host, so both directions
run at once), never by the host thread:
  load group g+1 (h2d stream)   while   attention on group g (compute stream)
  h2d waits `used[buf]` (compute done with the buffer) and `stored[buf]` (its dK/dV are back
  on the host) before it overwrites a buffer; compute waits `ready[buf]` before reading it;
  dK/dV go back (d2h stream) right after a group's backward; K/V never go back (the host copy
  written in stage 1 is never changed); a sweep's first load waits for the previous sweep's
  write-backs.
The first group of a layer is loaded ahead (`prefetch()`, called by the engine before the
layer's projections in forward and when its backward starts), so it hides behind compute too.
In stage 2 a sparse layer's selection is known for every layer, and its pages are one group: the
engine then prefetches the next layer's group while this one's is in use (the two buffers
alternate between groups), so a host layer's transfer hides behind the whole layer before it.
A chunk's host dK/dV pages are zeroed when its K/V are written (a copy from a zero buffer on
the device: no host-thread memset), so every later read of them is valid, whichever pages a
sliding window or a sparse selection happens to reach.
Sparse attention's representatives of a host layer live on the host too (so GPU memory does not
grow with the context by them): a selection loads the layer's [0, n) into one reused device
buffer, on the copy stream after the compute before it.
Sparse attention reads only a chunk's candidate pages, scattered over the arena: they are
staged as one group. Where only the GPU knows them (stage 1, which has just selected them) by
`copy_rows`, a kernel that reads the pinned pages directly (and writes their dK/dV back the same
way), from a row list computed on the GPU: no host sync, one launch. Stage 2 reuses stage 1's
selections, whose pages were copied to the host as they were made (`copy_rows_to_host`: an
asynchronous copy and an event, long done when stage 2 needs them): there the copy engines move
the pages (memory/dma.py: one batched driver call per transfer), leaving every SM to the compute.
On a CPU model the same code runs with plain memory and synchronous copies.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from .dma import batch_copier, copy_rows, row_copies
from .pinned import empty_pinned
from .spec import KVShape, LayerPages, ScheduledGroups


class HostLayer(NamedTuple):
    """One host layer's pinned pages (the arena, module docstring): dk, dv with gradient pages,
    reps with sparse attention, else None."""

    k: torch.Tensor
    v: torch.Tensor
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    reps: torch.Tensor | None = None


class Staged(NamedTuple):
    """One staging buffer on the device: k, v (and dk, dv with gradient pages)."""

    k: torch.Tensor
    v: torch.Tensor
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None


class HostPages:
    def __init__(self, shape: KVShape, layers: list[int], device: torch.device, copy_engines: bool = True,
                 local_ranks: int = 1) -> None:
        self.shape, self.spec = shape, shape.page
        self.rep_size = shape.rep_size  # vectors per page and KV head of sparse representatives (0: dense)
        self.layers = layers
        self.device = torch.device(device)
        self.group_pages = shape.staged_pages  # a dense group, or a sparse selection's pages at most
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None  # host -> GPU
        self.d2h_stream = torch.cuda.Stream(self.device) if self.cuda else None
        # the copy engines' batched copy, if the driver has it (else the zero-copy kernel, copy_rows)
        self.dma = batch_copier() if self.cuda and copy_engines else None
        self.local_ranks = local_ranks
        self.arena: dict[int, HostLayer] = {}
        self.batch = self.max_pages = 0
        self.staging: list[Staged] = []  # the two buffers
        self.rep_staging: torch.Tensor | None = None  # one host layer's representatives, on the device
        self.ready = [self._event(), self._event()]
        self.used = [self._event(), self._event()]
        self.stored = [self._event(), self._event()]
        # buffer -> the key (layer, with_grad, first span, gather rows) of the group loading into
        # it ahead of its use; the next group to start takes buffer _next (they alternate)
        self._prefetched: dict[int, tuple] = {}
        self._next = 0
        self._zeros: torch.Tensor | None = None  # (n, B, Hkv, P, D) grad dtype, copied over new dK/dV pages
        self._rows_block = torch.empty(0, dtype=torch.int32)  # selections' pages on the host (copy_rows_to_host)
        self._rows_used = 0

    # -- sizes ----------------------------------------------------------------------------

    def host_bytes(self, batch: int, max_pages: int) -> int:
        return len(self.layers) * batch * max_pages * self.shape.layer_page_bytes

    @property
    def arena_bytes(self) -> int:
        """Host bytes its arena holds now (pinned, for a CUDA device)."""
        return self.host_bytes(self.batch, self.max_pages)

    def staging_bytes(self, batch: int, max_pages: int) -> int:
        if not self.layers:
            return 0
        return self.shape.staging_bytes(batch, max_pages)

    def begin_step(self, batch: int, max_pages: int) -> None:
        if not self.layers:
            return
        self._prefetched.clear()  # a step cut short may have left loads nobody used
        self._rows_used = 0  # the last step's selections are gone
        if batch != self.batch or max_pages > self.max_pages:
            s = self.spec
            shape = (max_pages, batch, s.n_kv_heads, s.page_size, s.head_dim)
            self.arena = {}  # free the old arena before pinning the new one
            pin = self.cuda
            dtypes = (s.dtype, s.dtype) + ((s.grad_dtype, s.grad_dtype) if s.grads else ())
            reps = (max_pages, batch, s.n_kv_heads, self.rep_size, s.head_dim)
            self.arena = {layer: HostLayer(*(empty_pinned(shape, dt, pin, self.local_ranks) for dt in dtypes),
                                           **({"reps": empty_pinned(reps, s.dtype, pin, self.local_ranks)}
                                              if self.rep_size else {}))
                          for layer in self.layers}
            if self.rep_size:
                self.rep_staging = torch.empty(reps, dtype=s.dtype, device=self.device)
            n = self.shape.staged_slots(max_pages)
            slots = (n * batch, s.n_kv_heads, s.page_size, s.head_dim)
            self.staging = [Staged(*(torch.empty(slots, dtype=dt, device=self.device) for dt in dtypes))
                            for _ in range(2)]
            # staged page j of sequence b sits in slot j*B + b
            self.table = torch.arange(n * batch, dtype=torch.int32, device=self.device).view(n, batch).t()  # (B, n)
            self.batch, self.max_pages = batch, max_pages

    # -- stage 1: store a chunk -------------------------------------------------------------

    def write(self, layer: int, first_page: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (B, Hkv, n*P, D) on the device -> host pages [first_page, first_page + n)."""
        host = self.arena[layer]
        n = k.shape[2] // self.spec.page_size
        for x, dst in ((k, host.k), (v, host.v)):
            b, h, t, d = x.shape
            pages = x.reshape(b, h, n, t // n, d).permute(2, 0, 1, 3, 4).contiguous()  # (n, B, Hkv, P, D)
            with self._on_copy_stream(after_compute=True):
                dst[first_page : first_page + n].copy_(pages, non_blocking=True)
            if self.cuda:
                pages.record_stream(self.copy_stream)  # keep it alive until the copy is done
        if not self.spec.grads:
            return
        zeros = self._zero_pages(n)
        with self._on_copy_stream(after_compute=True):  # the zero buffer was made on the compute stream
            for grads in (host.dk, host.dv):
                grads[first_page : first_page + n].copy_(zeros, non_blocking=True)

    def write_reps(self, layer: int, first_page: int, reps: torch.Tensor) -> None:
        """reps: (B, n, Hkv, R, D) on the device -> the host's [first_page, first_page + n)."""
        pages = reps.transpose(0, 1).contiguous()  # (n, B, Hkv, R, D)
        with self._on_copy_stream(after_compute=True):
            self.arena[layer].reps[first_page : first_page + pages.shape[0]].copy_(pages, non_blocking=True)
        if self.cuda:
            pages.record_stream(self.copy_stream)

    def representatives(self, layer: int, n_pages: int) -> torch.Tensor:
        """(B, n_pages, Hkv, R, D) on the device, valid on the current stream until the next call."""
        staged = self.rep_staging[:n_pages]
        with self._on_copy_stream(after_compute=True):  # after the last selection read the buffer
            staged.copy_(self.arena[layer].reps[:n_pages], non_blocking=True)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        return staged.transpose(0, 1)

    def earlier_keys(self, layer: int, n_pages: int) -> torch.Tensor:
        """(B, Hkv, n_pages * P, D) on the device: a copy of the layer's first n_pages keys."""
        keys = self.arena[layer].k
        out = torch.empty((n_pages,) + keys.shape[1:], dtype=self.spec.dtype, device=self.device)
        with self._on_copy_stream(after_compute=True):  # after the writes queued on the same stream
            out.copy_(keys[:n_pages], non_blocking=True)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
            out.record_stream(self.copy_stream)
        n, b, h, p, d = out.shape
        return out.permute(1, 2, 0, 3, 4).reshape(b, h, n * p, d)

    def _zero_pages(self, n: int) -> torch.Tensor:
        if self._zeros is None or self._zeros.shape[0] < n or self._zeros.shape[1] != self.batch:
            s = self.spec
            self._zeros = torch.zeros((n, self.batch, s.n_kv_heads, s.page_size, s.head_dim),
                                      dtype=s.grad_dtype, device=self.device)
        return self._zeros[:n]

    # -- reading: groups of pages on the device --------------------------------------------

    def page_groups(self, layer: int, first: int, n_pages: int, extra: dict,
                    pages: torch.Tensor | None = None, host_pages: tuple | None = None) -> ScheduledGroups:
        """Pages [first, n_pages) of `layer`, or only `pages` ((B, n) logical pages on the
        device: a sparse selection's, staged as one group by a gather; `host_pages`, their copy
        from copy_rows_to_host, lets the copy engines gather them)."""
        return _HostGroups(self, layer, first, n_pages, extra, pages, host_pages)

    def copy_rows_to_host(self, pages: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Starts copying `pages` (a selection's, int32 on the device) to pinned host memory after
        the compute queued so far; returns the host tensor and the copy's event (None on CPU).
        The host memory is a bump allocation in pinned blocks, reset each step."""
        n = pages.numel()
        if self._rows_used + n > self._rows_block.numel():
            self._rows_block = torch.empty(max(2 * self._rows_block.numel(), n, 2**16), dtype=torch.int32,
                                           pin_memory=self.cuda)  # earlier views keep the old block alive
            self._rows_used = 0
        host = self._rows_block[self._rows_used : self._rows_used + n].view(pages.shape)
        self._rows_used += n
        host.copy_(pages, non_blocking=True)
        done = self._event()
        if self.cuda:
            done.record(torch.cuda.current_stream(self.device))
        return host, done

    def chunk_grads(self, layer: int, first_page: int, n_pages: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """Starts copying the dK, dV later chunks accumulated for a chunk's own keys to the device;
        returns the function that gives them, (B, Hkv, n*P, D), when the backward needs them.

        Started in stage 2's forward, the copy is done long before the layer's backward; fetched
        then, the compute stream waited on the copy stream, which waits on the write-backs the
        backward had just queued (~1.3 ms idle per host layer and chunk at 1M tokens).
        """
        with self._on_copy_stream(after_compute=False):
            if self.cuda:
                self.copy_stream.wait_stream(self.d2h_stream)  # the previous chunk's write-backs
            host = self.arena[layer]
            pair = [grads[first_page : first_page + n_pages].to(self.device, non_blocking=True)
                    for grads in (host.dk, host.dv)]
        copied = self._event()
        if self.cuda:
            copied.record(self.copy_stream)

        def ready() -> tuple[torch.Tensor, torch.Tensor]:
            if self.cuda:
                compute = torch.cuda.current_stream(self.device)
                compute.wait_event(copied)
                for x in pair:
                    x.record_stream(compute)
            n, b, h, p, d = pair[0].shape
            dk, dv = (x.permute(1, 2, 0, 3, 4).reshape(b, h, n * p, d) for x in pair)  # (B, Hkv, n*P, D)
            return dk, dv

        return ready

    # -- transfers ------------------------------------------------------------------------

    def _load(self, buf: int, layer: int, span: tuple[int, int], with_grad: bool,
              rows: torch.Tensor | None = None, host_rows: np.ndarray | None = None) -> None:
        """Stage pages [start, end) of `layer` (or the host rows `rows`: a gather; by the copy
        engines when the host has them, `host_rows`) in `buf`: K, V, and dK, dV `with_grad`."""
        with self._on_copy_stream(after_compute=False):
            if self.cuda:
                self.copy_stream.wait_event(self.used[buf])  # compute is done with this buffer
                self.copy_stream.wait_event(self.stored[buf])  # and its dK/dV are back on the host
            names = ("k", "v", "dk", "dv") if with_grad else ("k", "v")
            self._transfer(names, buf, layer, span, False, rows, host_rows, self.copy_stream)
            if self.cuda:
                self.ready[buf].record(self.copy_stream)

    def _store_grads(self, buf: int, layer: int, span: tuple[int, int], rows: torch.Tensor | None = None,
                     host_rows: np.ndarray | None = None) -> None:
        """The dK, dV of a group staged in `buf` back to the host, once compute is done with them."""
        with torch.cuda.stream(self.d2h_stream) if self.cuda else contextlib.nullcontext():
            if self.cuda:
                self.d2h_stream.wait_event(self.used[buf])
            self._transfer(("dk", "dv"), buf, layer, span, True, rows, host_rows, self.d2h_stream)
            if self.cuda:
                self.stored[buf].record(self.d2h_stream)

    def _transfer(self, names: tuple[str, ...], buf: int, layer: int, span: tuple[int, int], to_host: bool,
                  rows: torch.Tensor | None, host_rows: np.ndarray | None, stream) -> None:
        """The one copy between `layer`'s arena and staging buffer `buf`, of the tensors `names`, on
        the current stream: a gather's rows by the copy engines (`host_rows`) or by copy_rows
        (`rows`), else pages [start, end), one contiguous range each side."""
        start, end = span
        pairs = [(getattr(self.arena[layer], x).flatten(0, 1), getattr(self.staging[buf], x)) for x in names]
        if host_rows is not None:
            self._batch([row_copies(staged, None, host, host_rows) if to_host
                         else row_copies(host, host_rows, staged, None) for host, staged in pairs], stream)
        elif rows is not None:
            for host, staged in pairs:
                if to_host:
                    copy_rows(staged, None, host, rows)
                else:
                    copy_rows(host, rows, staged, None)
        else:
            lo, hi = start * self.batch, end * self.batch  # staged page j of sequence b: row j * B + b
            for host, staged in pairs:
                if to_host:
                    host[lo:hi].copy_(staged[: hi - lo], non_blocking=True)
                else:
                    staged[: hi - lo].copy_(host[lo:hi], non_blocking=True)

    def _batch(self, copies: list[tuple[np.ndarray, np.ndarray, np.ndarray]], stream) -> None:
        """One batched copy-engine call for every (dsts, srcs, sizes) of `copies`."""
        dsts, srcs, sizes = (np.concatenate(parts) for parts in zip(*copies))
        self.dma(dsts, srcs, sizes, stream.cuda_stream if stream is not None else 0)

    def _on_copy_stream(self, after_compute: bool):
        if not self.cuda:
            return contextlib.nullcontext()
        if after_compute:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.copy_stream)

    def _event(self):
        return torch.cuda.Event() if self.cuda else None


def _gather_rows(pages: torch.Tensor) -> torch.Tensor:
    """The arena rows of a gathered group, (n * B,) int64 on pages' device: staged page j of
    sequence b is host page pages[b, j] of b, arena row pages[b, j] * B + b."""
    b = pages.shape[0]
    return (pages.t().long() * b + torch.arange(b, device=pages.device)).flatten()


class _HostGroups:
    """A host layer's earlier pages as groups staged on the device (a ScheduledGroups)."""

    def __init__(self, host: HostPages, layer: int, first: int, n_pages: int, extra: dict,
                 pages: torch.Tensor | None, host_pages: tuple | None = None) -> None:
        self.host, self.layer, self.extra = host, layer, extra
        g = host.group_pages
        self.rows = None  # the kernel's gather rows on the device
        self._host_pages, self._host_rows = host_pages, None
        self._gather = None  # which gather a prefetch was for (this one's: id(self))
        self._then: dict[bool, object] = {}  # pass (with_grad) -> the groups to load after this one's
        if pages is None:
            self.spans = [(s, min(s + g, n_pages)) for s in range(first, n_pages, g)]
        else:  # one gathered group: staged page j of sequence b is host page pages[b, j] of b
            n = pages.shape[1]
            assert n <= g, f"{n} selected pages do not fit {g} staging slots"
            self.spans = [(0, n)] if n else []
            self._gather = id(self)
            if host_pages is None:  # without a host copy of the selection the kernel gathers
                self.rows = _gather_rows(pages)
                if host.cuda:  # made on the compute stream, read on the copy streams
                    self.rows_ready = torch.cuda.Event()
                    self.rows_ready.record(torch.cuda.current_stream(host.device))
                    self.rows.record_stream(host.copy_stream)
                    self.rows.record_stream(host.d2h_stream)

    @property
    def host_rows(self) -> np.ndarray | None:
        """The gather's rows on the host (the copy engines' work), once the host copy of the
        selection is done; None without one (the kernel gathers)."""
        if self._host_rows is None and self._host_pages is not None:
            pages, done = self._host_pages
            if done is not None:
                done.synchronize()  # stage 1 made it: done long ago
            self._host_rows = _gather_rows(pages).numpy()
        return self._host_rows

    def prefetch(self, with_grad: bool) -> None:
        """Start loading the first group now, so the load hides behind the compute before it.
        Two groups can be loading or loaded at once (one per staging buffer): the engine asks for
        the next layer's while this one's are in use."""
        if self.spans and self._key(with_grad) not in self.host._prefetched.values():
            self.host._prefetched[self._begin(with_grad)] = self._key(with_grad)

    def then(self, with_grad: bool, groups: ScheduledGroups) -> None:
        """Start loading `groups`' first group (the next layer this pass reads) as early as the two
        staging buffers allow: now when this layer's pages are one group, else once its last group
        is in use (until then its groups alternate between the buffers)."""
        if len(self.spans) > 1:
            self._then[with_grad] = groups
        else:
            groups.prefetch(with_grad)

    def _key(self, with_grad: bool) -> tuple:
        return self.layer, with_grad, self.spans[0], self._gather

    def _begin(self, with_grad: bool) -> int:
        """Load the first group into the next staging buffer; returns the buffer."""
        host = self.host
        buf, host._next = host._next, 1 - host._next
        host._prefetched.pop(buf, None)  # whatever was loading there is overwritten
        if host.cuda:
            if with_grad:
                host.copy_stream.wait_stream(host.d2h_stream)  # the previous sweep's write-backs
            if self.rows is not None:
                host.copy_stream.wait_event(self.rows_ready)
        host._load(buf, self.layer, self.spans[0], with_grad, self.rows, self.host_rows)
        return buf

    def __call__(self, with_grad: bool):
        host, layer, spans = self.host, self.layer, self.spans
        if not spans:
            staged = host.staging[0]
            yield LayerPages(staged.k, staged.v, *((staged.dk, staged.dv) if with_grad else (None, None)),
                             host.table[:, :0], 0, **self.extra)
            return
        key = self._key(with_grad)
        first = next((b for b, k in host._prefetched.items() if k == key), None)
        if first is None:
            first = self._begin(with_grad)
        host._prefetched.pop(first, None)
        for g, (start, end) in enumerate(spans):
            buf = (first + g) % 2
            if g + 1 < len(spans):  # load the next group while this one is computed on
                host._prefetched.pop(1 - buf, None)  # a later layer's group loading there is overwritten
                host._next = buf  # and the group after this layer starts in the other buffer
                host._load(1 - buf, layer, spans[g + 1], with_grad)
            elif with_grad in self._then:  # the next layer's first group, into the buffer this layer is done with
                host._next = 1 - buf
                self._then.pop(with_grad).prefetch(with_grad)
            if host.cuda:
                torch.cuda.current_stream(host.device).wait_event(host.ready[buf])
            staged = host.staging[buf]
            yield LayerPages(staged.k, staged.v, *((staged.dk, staged.dv) if with_grad else (None, None)),
                             host.table[:, : end - start], start, **self.extra)
            if host.cuda:
                host.used[buf].record(torch.cuda.current_stream(host.device))
            if with_grad:
                host._store_grads(buf, layer, (start, end), self.rows, self.host_rows)
