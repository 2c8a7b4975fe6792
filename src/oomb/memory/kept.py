"""Stage 1's attention outputs and LSEs, kept so that stage 2 does not compute that attention again.

Stage 2 recomputes each chunk's forward under autograd; with a layer's attention output O and
LSE from stage 1 (the same inputs give the same values), the recompute skips the attention
forward, the step's largest recomputed kernel at long contexts (H200, Qwen2.5-7B: a 256K dense
step 176.4 -> 149.9 s; a 1M top-k step ~0.3 s per kept layer). What one (chunk, layer) takes:
B x C x H x D in the weights' dtype + B x H x C fp32 (28.4 MiB at chunk 4096), every stored chunk.

Kept on the GPU, as many layers as fit beside the pages; the other layers' in pinned host
memory, as many as the host budget holds. The host arena is one pinned block (memory/pinned.py: exactly its
bytes) of fixed-size entries; each entry's slot comes from a free list of plain integers.
Transfers are ordered by CUDA events, never by the host thread:
  put (stage 1):  the GPU->host stream waits for the attention that made O, then copies it out;
  load (stage 2): the host->GPU stream waits for those copies (long done by then) and for the compute
                  queued before the device buffers were allocated, then copies in; the compute
                  stream waits for a layer's copy only when that layer's attention runs.
Stage 2 loads a chunk's outputs `LOOKAHEAD` layers ahead of their use, so each ~1 ms transfer
hides behind the layers before it. On a CPU model the same code runs with synchronous copies.
"""
from __future__ import annotations

import contextlib

import torch

from .pinned import empty_pinned

LOOKAHEAD = 2  # layers between a kept output's load and its use in stage 2
_ALIGN = 256


class KeptAttention:
    def __init__(self, device: torch.device, local_ranks: int = 1) -> None:
        self.device = torch.device(device)
        self.local_ranks = local_ranks  # processes of this machine pinning host memory (memory/pinned.py)
        self.cuda = self.device.type == "cuda"
        self.layers: tuple[int, ...] = ()  # the layers kept this step, in load order
        self.host_layers: frozenset[int] = frozenset()  # those of them kept in host memory
        self._device: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._slot: dict[tuple[int, int], int] = {}  # host entries
        self._loaded: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, object]] = {}
        self._arena: torch.Tensor | None = None  # pinned uint8, n entries
        self._entry_bytes = 0
        self._free: list[int] = []
        self.h2d = torch.cuda.Stream(self.device) if self.cuda else None
        self.d2h = torch.cuda.Stream(self.device) if self.cuda else None
        self._shapes: tuple[tuple[int, ...], tuple[int, ...], torch.dtype] | None = None

    # -- sizes --------------------------------------------------------------------------------

    @staticmethod
    def entry_bytes(batch: int, chunk_size: int, heads: int, head_dim: int, item: int) -> int:
        """One (chunk, layer): O (B, H, C, D) and LSE (B, H, C) fp32, each 256-byte aligned."""
        o = batch * heads * chunk_size * head_dim * item
        lse = batch * heads * chunk_size * 4
        return -(-o // _ALIGN) * _ALIGN + -(-lse // _ALIGN) * _ALIGN

    @staticmethod
    def host_bytes(n_entries: int, entry_bytes: int) -> int:
        """Pinned bytes an arena of n_entries takes."""
        return n_entries * entry_bytes

    @property
    def n_entries(self) -> int:
        """(chunk, layer) outputs held now."""
        return len(self._device) + len(self._slot)

    @property
    def where(self) -> str | None:
        """Where this step keeps outputs: 'gpu', 'host', 'gpu+host' (some layers' each), None (none)."""
        if not self.layers:
            return None
        return "host" if len(self.host_layers) == len(self.layers) else "gpu+host" if self.host_layers else "gpu"

    @property
    def arena_bytes(self) -> int:
        return 0 if self._arena is None else self._arena.numel()

    # -- the step -----------------------------------------------------------------------------

    def begin_step(self, layers: list[int], host_layers: list[int], n_chunks: int, o_shape: tuple[int, ...],
                   dtype: torch.dtype) -> None:
        """Keep `layers` of chunks [0, n_chunks) this step, those of `host_layers` in host memory;
        o_shape: (B, H, C, D)."""
        self.clear()
        self.layers, self.host_layers = tuple(layers), frozenset(host_layers)
        b, h, c, d = o_shape
        self._shapes = (o_shape, (b, h, c), dtype)
        if not self.host_layers:
            return
        entry = self.entry_bytes(b, c, h, d, dtype.itemsize)
        n = len(self.host_layers) * n_chunks
        if entry != self._entry_bytes or n > len(self._free):
            self._arena = None  # free the old arena before pinning the new one
            self._arena = empty_pinned((n * entry,), torch.uint8, pin=self.cuda, local_ranks=self.local_ranks)
            self._entry_bytes = entry
            self._free = list(range(n))

    def put(self, c: int, i: int, o: torch.Tensor, lse: torch.Tensor) -> None:
        """Stage 1: keep layer i's (o, lse) of chunk c (i in self.layers)."""
        if i not in self.host_layers:
            self._device[c, i] = (o, lse)
            return
        slot = self._free.pop()
        host_o, host_lse = self._views(slot)
        with self._after_compute(self.d2h):
            host_o.copy_(o, non_blocking=True)
            host_lse.copy_(lse, non_blocking=True)
        if self.cuda:
            o.record_stream(self.d2h)  # alive until the copy is done
            lse.record_stream(self.d2h)
        self._slot[c, i] = slot

    def load(self, c: int, i: int) -> None:
        """Stage 2: start copying layer i's kept output of chunk c to the device (no-op when it
        is on the device, loading, or not kept)."""
        key = (c, i)
        if key not in self._slot or key in self._loaded:
            return
        o_shape, lse_shape, dtype = self._shapes
        o = torch.empty(o_shape, dtype=dtype, device=self.device)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=self.device)
        host_o, host_lse = self._views(self._slot[key])
        with self._after_compute(self.h2d):  # after the compute that freed the buffers' memory
            if self.cuda:
                self.h2d.wait_stream(self.d2h)  # stage 1's copies out are done
            o.copy_(host_o, non_blocking=True)
            lse.copy_(host_lse, non_blocking=True)
        done = None
        if self.cuda:
            done = torch.cuda.Event()
            done.record(self.h2d)
            o.record_stream(self.h2d)
            lse.record_stream(self.h2d)
        self._loaded[key] = (o, lse, done)

    def prefetch(self, c: int) -> None:
        """Stage 2, at chunk c's start: load its first layers' kept outputs."""
        for i in range(LOOKAHEAD + 1):
            self.load(c, i)

    def has(self, c: int, i: int) -> bool:
        """Whether layer i of chunk c has a kept output (its stage-2 forward reads no page)."""
        return (c, i) in self._device or (c, i) in self._slot

    def get(self, c: int, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(o, lse) of layer i of chunk c on the device, usable on the current stream; None when
        not kept. Stage 2 also starts loading the layer LOOKAHEAD ahead."""
        if (c, i) in self._device:
            return self._device[c, i]
        if (c, i) not in self._slot:
            return None
        for j in range(i, i + LOOKAHEAD + 1):
            self.load(c, j)
        o, lse, done = self._loaded[c, i]
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        return o, lse

    def drop(self, c: int) -> None:
        """Chunk c's stage 2 is done: free its entries (their slots are reused next step)."""
        for i in self.layers:
            self._device.pop((c, i), None)
            self._loaded.pop((c, i), None)
            slot = self._slot.pop((c, i), None)
            if slot is not None:
                self._free.append(slot)

    def clear(self) -> None:
        self._free.extend(self._slot.values())
        self._slot.clear()
        self._device.clear()
        self._loaded.clear()

    # -- internals ------------------------------------------------------------------------------

    def _views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        o_shape, lse_shape, dtype = self._shapes
        offset = slot * self._entry_bytes
        o_bytes = torch.Size(o_shape).numel() * dtype.itemsize
        lse_at = offset + -(-o_bytes // _ALIGN) * _ALIGN
        o = self._arena[offset : offset + o_bytes].view(dtype).view(o_shape)
        lse = self._arena[lse_at : lse_at + torch.Size(lse_shape).numel() * 4].view(torch.float32).view(lse_shape)
        return o, lse

    def _after_compute(self, stream):
        """Run on `stream` once the compute queued so far is done (nothing on a CPU model)."""
        if not self.cuda:
            return contextlib.nullcontext()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

