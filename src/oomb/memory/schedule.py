"""When a step's transfers start and how far the host thread runs ahead of the GPU.

LookAhead starts each of stage 2's host-page transfers a layer before the layer that reads
them; HostLead keeps the host thread, which queues the work, at most HOST_LEAD_CHUNKS chunk
passes ahead of the GPU, so that the buffers crossing streams are freed while the caching
allocator can still reuse them.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from .kept import KeptAttention
from .spec import ScheduledGroups

HOST_LEAD_CHUNKS = 2  # chunk passes the host queues ahead of the GPU (HostLead)


class LookAhead:
    """Stage 2's page transfers for one chunk, each started a layer early: a host layer's first
    group of pages starts loading while the layer before it (the one after it, in backward)
    still computes, into the staging buffer that layer is done with (ScheduledGroups.then), so
    the transfer hides behind that layer's attention and MLP.

    known_groups(j): layer j's groups of earlier pages, when known before its projections (the
    engine's, for this chunk), else None. adapter: the model's (models/). With checkpoint_layers,
    a layer's forward runs again in its backward: nothing is started early."""

    def __init__(self, c: int, known_groups: Callable[[int], ScheduledGroups | None], adapter,
                 kept: KeptAttention, checkpoint_layers: bool) -> None:
        self.c, self.known_groups, self.adapter, self.kept = c, known_groups, adapter, kept
        self.checkpoint_layers = checkpoint_layers
        self.groups: dict[int, ScheduledGroups | None] = {}  # layer -> its groups, made (loading) a layer early

    def forward(self, i: int, groups: ScheduledGroups) -> None:
        """Layer i's forward reads `groups`: the next layer's may start loading."""
        self.groups[i] = groups
        self._next(i, i + 1, False)

    def backward_starts(self, groups: ScheduledGroups, i: int, grad: torch.Tensor) -> None:
        """A hook on layer i's output: its backward starts when the output's gradient is ready.
        Load its first group of pages (and their dK/dV) then, behind the MLP's backward, if the
        layer after it did not already, and the next layer's (i - 1)."""
        groups.prefetch(True)
        self._next(i, i - 1, True)

    def _next(self, i: int, j: int, with_grad: bool) -> None:
        """Start layer j's first group after layer i's (j read next in this pass)."""
        c, a = self.c, self.adapter
        if self.checkpoint_layers or not 0 <= j < a.n_layers or a.window(i):
            return
        if not with_grad and self.kept.has(c, j):
            return  # its forward reads no page: its output was kept by stage 1
        if self.groups.get(j) is None:
            # None: selected by its own queries (the last chunk)
            self.groups[j] = self.known_groups(j)
        if self.groups[j] is None:
            return
        if with_grad or not self.kept.has(c, i):  # layer i reads its pages in this pass
            self.groups[i].then(with_grad, self.groups[j])
        else:
            self.groups[j].prefetch(with_grad)


class HostLead:
    """Keeps the host thread at most `depth` chunks ahead of the GPU.

    Without it, a GPU-bound step lets Python queue chunk after chunk; every buffer that
    crosses streams (pages going to or coming from the host, `record_stream`) is then freed
    long before the GPU is done with it, and the caching allocator cannot reuse it: device
    memory would grow with the context. Two chunks of lead keep the GPU busy; the wait is one
    event per chunk, not per page.
    """

    def __init__(self, device: torch.device, depth: int = HOST_LEAD_CHUNKS) -> None:
        self.cuda = device.type == "cuda"
        self.depth = depth
        self.events: deque = deque()

    def chunk_done(self) -> None:
        if not self.cuda:
            return
        event = torch.cuda.Event()
        event.record()
        self.events.append(event)
        if len(self.events) > self.depth:
            oldest = self.events.popleft()
            if not oldest.query():  # wait only when the GPU really is behind
                oldest.synchronize()
