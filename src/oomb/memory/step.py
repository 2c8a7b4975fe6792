"""A step's memory: its sizes as placement.place() reads them, the room measured for them, and
the check that refuses a step the memory cannot hold before anything is computed.

The device's room for pages and kept attention outputs is measured once, at the engine's first
step (or reserve()), and kept, so that every step places its pages alike and the pinned host
arenas are reused, not pinned again; so is the host budget of kept outputs. The sizes are the
store's KVShape's (memory/spec.py); `oomb plan` gives place() the same numbers from the KVShape
it builds from a config (plan.py), so the plan describes the step the engine runs.

The methods that read the engine's config take it as it is at the call: a caller may replace it
between steps (a page budget for one step, a reserve for what is still to come).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config import EngineConfig
from ..grad_sums import summed_params
from ..parallel import local_tensor
from ..placement import PlacementInput, human_bytes, place
from ..plan import gpu_margin, plan
from .device import device_memory
from .kept import KeptAttention
from .pinned import available_host_bytes
from .store import PagedKVStore

HOST_MARGIN_BYTES = 4 * 2**30  # host memory kept attention outputs leave free (the process, the OS)


class StepMemory:
    """The memory of an engine's steps: the model's, its adapter's (models/), its page store's
    (sized by the store's KVShape) and its kept attention outputs', on `device`."""

    def __init__(self, model: nn.Module, adapter, store: PagedKVStore, kept: KeptAttention,
                 device: torch.device) -> None:
        self.model, self.adapter, self.store, self.kept, self.device = model, adapter, store, kept, device
        self.shape = store.shape
        # Measured at the first step and kept: the device bytes free for pages and kept outputs,
        # and the host bytes kept outputs may pin.
        self.gpu_room: int | None = None
        self.kept_host_budget: int | None = None

    def pinned_bytes(self) -> int:
        """Pinned host memory held: the host pages' arena and kept attention outputs."""
        return self.store.host.arena_bytes + self.kept.arena_bytes

    def placement_input(self, cfg: EngineConfig, batch: int, max_pages: int, training: bool = True) -> PlacementInput:
        """A step of `batch` sequences and `max_pages` stored pages, as numbers for
        placement.place(): its sizes, and on a GPU the room measured at the first step."""
        shape, spec = self.shape, self.shape.page
        n_chunks = max_pages // shape.chunk_pages
        cuda = self.device.type == "cuda"
        if cuda and self.gpu_room is None:
            self.gpu_room = self.headroom(cfg)
        kept = self.kept_order(cfg, training, max_pages)
        entry = KeptAttention.entry_bytes(batch, shape.chunk_size, shape.query_heads, spec.head_dim,
                                          spec.dtype.itemsize)
        pages = PlacementInput(
            offload=cfg.offload, full_layers=len(shape.full_layers),
            layer_bytes=batch * max_pages * shape.layer_page_bytes,
            window_bytes=shape.window_bytes(batch, n_chunks),
            staging_bytes=shape.staging_bytes(batch, max_pages),
            gpu_room=self.gpu_room if cuda else None, page_budget=cfg.gpu_page_budget_bytes,
            held_bytes=self._pool_bytes if cuda else 0)
        if not kept:
            return pages
        budget = cfg.kept_host_bytes if cfg.kept_host_bytes is not None else self.kept_host_budget
        if budget is None:  # half of what is free besides this step's host pages (and the margin)
            budget = self._free_host_budget(cfg, place(pages).host_bytes)
        return dataclasses.replace(
            pages, kept_layers=len(kept),
            kept_gpu_bytes=self.attention_bytes(batch, max_pages, 1) if cuda else 0,
            kept_host_bytes=KeptAttention.host_bytes(n_chunks, entry), kept_host_budget=budget,
            keep_all=cfg.keep_attention is True)

    def kept_order(self, cfg: EngineConfig, training: bool, max_pages: int) -> list[int]:
        """The layers whose stage-1 attention outputs a step may keep, in order of preference:
        every layer but the last (stage 1 stops at its K/V), full-attention layers first (a
        window's attention is cheap to recompute); none when evaluating or keep_attention=False."""
        shape = self.shape
        if not training or cfg.keep_attention is False or max_pages < shape.chunk_pages:
            return []
        return sorted(range(shape.n_layers - 1), key=lambda i: (bool(shape.windows[i]), i))

    def _free_host_budget(self, cfg: EngineConfig, host_pages: int) -> int:
        """Host bytes kept attention outputs may pin by default: half of what is free besides the
        step's `host_pages` less a margin, shared among the processes of this machine."""
        free = max(0, available_host_bytes() + self.pinned_bytes() - host_pages - HOST_MARGIN_BYTES)
        return free // (2 * cfg.local_world_size)

    def headroom(self, cfg: EngineConfig) -> int:
        """Device bytes free for pages (and kept attention) now: free memory and the store's own
        pool, less one chunk's working set, what is still to come (parameter gradients not
        allocated yet, `reserved_gpu_bytes`) and a margin (plan.gpu_margin(): 5 % of the device, at
        least 2 GiB)."""
        a = self.adapter
        trainable = None if a.embed_tokens.weight.requires_grad else 0
        working_set = plan(a.config, cfg.chunk_size, engine=cfg, dtype=self.store.spec.dtype,
                           trainable_params=trainable, tp=a.n_kv_heads // a.local_kv_heads,
                           n_params=sum(local_tensor(p).numel() for p in self.model.parameters())).working_set
        # the summed parameters' sums, not their .grad, take the room during the step
        summed = set(summed_params(self.model, cfg.param_grad_dtype))
        grads = sum(local_tensor(p).numel() * p.element_size() for p in self.model.parameters()
                    if p.requires_grad and p.grad is None and p not in summed)
        grads += sum(local_tensor(p).numel() * torch.finfo(cfg.param_grad_dtype).bits // 8 for p in summed)
        later = grads + cfg.reserved_gpu_bytes
        return self.free_gpu_bytes() + self._pool_bytes - working_set - later - gpu_margin(self._gpu_capacity())

    def _gpu_capacity(self) -> int:
        """The device's memory this process may hold (0 off CUDA: the margin's floor applies)."""
        return device_memory(self.device)[1] if self.device.type == "cuda" else 0

    def free_gpu_bytes(self) -> int:
        """Free device memory, counting what the caching allocator holds but does not use (within
        a per-process memory fraction)."""
        return device_memory(self.device)[0]

    @property
    def _pool_bytes(self) -> int:
        """Device bytes of the store's page pool now (reused by the next step)."""
        return self.store.pool.n_slots * self.store.spec.page_bytes

    def check(self, cfg: EngineConfig, batch: int, max_pages: int, host_pages: int) -> None:
        """Refuse a step whose pages the host, or (offload 'none'/'all') the GPU, cannot hold now,
        before anything is computed, with what would fit and how to get there."""
        store = self.store
        pool_now = self._pool_bytes
        host_need = host_pages - store.host.arena_bytes
        if self.device.type == "cpu":  # a CPU model's "device" pool (and staging) is host memory too
            host_pages += store.device_pages(batch, max_pages) * store.spec.page_bytes
            host_need += store.device_bytes(batch, max_pages) - pool_now
        if host_need > 0:
            available = available_host_bytes()
            if host_need > available:
                tokens = max(1, batch * max_pages * store.spec.page_size)
                per_token = host_pages / tokens
                raise ValueError(
                    f"this step needs {human_bytes(host_need)} more host memory for its pages "
                    f"({human_bytes(per_token)} per token of context), but only {human_bytes(available)} is "
                    f"available: about {int(available / per_token):,} tokens would fit. Use a shorter context, "
                    "kv_grad_dtype=torch.bfloat16 (halves the gradient pages), offload='auto' (keeps part on the "
                    "GPU) or sparse attention."
                )
        if self.device.type == "cuda" and cfg.offload != "auto":
            kept = self.kept_bytes(batch, max_pages)
            need = store.device_bytes(batch, max_pages) - pool_now + kept
            free = self.free_gpu_bytes()
            if need > free:
                also = f" (of which {human_bytes(kept)} for keep_attention: leave it off)" if kept else ""
                raise ValueError(
                    f"the pages of this step need {human_bytes(need)} more GPU memory{also}, {human_bytes(free)} "
                    f"is free; use offload='auto' or offload='all' (pages on the host), a shorter context or "
                    "kv_grad_dtype=torch.bfloat16"
                )

    def kept_bytes(self, batch: int, max_pages: int) -> int:
        """Device bytes of the attention outputs and LSEs stage 1 keeps on the GPU (keep_attention),
        of this rank's query heads."""
        return self.attention_bytes(batch, max_pages, len(self.kept.layers) - len(self.kept.host_layers))

    def attention_bytes(self, batch: int, max_pages: int, n_layers: int | None = None) -> int:
        """What keeping the attention outputs and LSEs of n_layers (default: every layer but the
        last) takes (this rank's query heads)."""
        shape = self.shape
        n_layers = shape.n_layers - 1 if n_layers is None else n_layers
        return shape.kept_attention_bytes(max_pages // shape.chunk_pages, n_layers, batch)
